//! The nine upstream topology-remap cases; they give the same maps as
//! upstream.

use super::*;

#[test]
fn remap_test0_two_hives_device_ids_swapped() {
    let src = two_hives(0xA000, [0xD000, 0xD001], false);
    let dst = two_hives(0xB000, [0xD001, 0xD000], false);
    let map = expect_map(
        &src,
        &dst,
        &[
            (0xA000, 0xB014),
            (0xA001, 0xB015),
            (0xA002, 0xB016),
            (0xA003, 0xB017),
            (0xA014, 0xB000),
            (0xA015, 0xB001),
            (0xA016, 0xB002),
            (0xA017, 0xB003),
        ],
    );
    assert_eq!(map.cpu_mappings(), &[(0, 0), (1, 1)]);
}

#[test]
fn remap_test1_partial_p2p_identity() {
    let src = two_hives(0xA000, [0xD000, 0xD000], true);
    let dst = two_hives(0xB000, [0xD000, 0xD000], true);
    let map = expect_map(&src, &dst, &identity_pairs(4, true));
    assert_eq!(map.cpu_mappings(), &[(0, 0), (1, 1)]);
}

#[test]
fn remap_test2_hives_cannot_cross() {
    let src = two_hives(0xA000, [0xD000, 0xD001], true);
    let dst = two_hives(0xB000, [0xD001, 0xD000], true);
    let err = map_gpus(&src, &dst, &CompatChecks::default()).unwrap_err();
    assert!(
        matches!(
            err,
            MapError::HiveNotPlaceable { .. } | MapError::NoCompatibleGpu { .. }
        ),
        "{err}"
    );
}

#[test]
fn remap_test3_single_bidirectional_cpu_link_per_hive() {
    let src = hives_one_cpu_backlink(0xA000, [4, 9]);
    let dst = hives_one_cpu_backlink(0xB000, [2, 7]);
    let map = expect_map(
        &src,
        &dst,
        &[
            (0xA000, 0xB002),
            (0xA001, 0xB001),
            (0xA002, 0xB000),
            (0xA003, 0xB003),
            (0xA014, 0xB014),
            (0xA015, 0xB017),
            (0xA016, 0xB016),
            (0xA017, 0xB015),
        ],
    );
    assert_eq!(map.cpu_mappings(), &[(0, 0), (1, 1)]);
}

#[test]
fn remap_test4_cpu_link_moved_fails() {
    let src = hives_one_cpu_backlink(0xA000, [4, 9]);
    let dst = hives_one_cpu_backlink(0xB000, [2, 6]);
    let err = map_gpus(&src, &dst, &CompatChecks::default()).unwrap_err();
    assert!(err.to_string().contains("0xa017"), "{err}");
}

#[test]
fn remap_test5_one_hive_plus_pcie_identity() {
    let src = one_hive_four_pcie(0xA000);
    let dst = one_hive_four_pcie(0xB000);
    let map = expect_map(&src, &dst, &identity_pairs(4, true));
    assert_eq!(map.cpu_mappings(), &[(0, 0), (1, 1)]);
}

#[test]
fn remap_test6_five_gpus_mixed_device_ids() {
    let src = five_gpus(0xA000, [0xD000, 0xD000, 0xD001, 0xD000, 0xD001], 5);
    let dst = five_gpus(0xB000, [0xD000, 0xD001, 0xD000, 0xD000, 0xD001], 5);
    let map = expect_map(
        &src,
        &dst,
        &[
            (0xA000, 0xB000),
            (0xA001, 0xB002),
            (0xA002, 0xB001),
            (0xA003, 0xB003),
            (0xA004, 0xB004),
        ],
    );
    assert_eq!(map.cpu_mappings(), &[(0, 0)]);
}

#[test]
fn remap_test7_restore_has_extra_hive() {
    let src = hive_plus_four(0xA000, false);
    let dst = hive_plus_four(0xB000, true);
    let map = expect_map(&src, &dst, &identity_pairs(4, true));
    assert_eq!(map.cpu_mappings(), &[(0, 0), (1, 1)]);
}

#[test]
fn remap_test8_restore_has_more_p2p_links() {
    let devs = [0xD000; 5];
    let src = five_gpus(0xA000, devs, 4);
    let dst = five_gpus(0xB000, devs, 5);
    let map = expect_map(&src, &dst, &identity_pairs(5, false));
    assert_eq!(map.cpu_mappings(), &[(0, 0)]);
}
