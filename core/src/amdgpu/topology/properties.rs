//! The GPU properties the plugin records in the image and compares on
//! restore, listed once.
//!
//! Each row of the table below names a property, which is at the same time
//! the [`GpuNode`] field, the image's [`DeviceEntry`] field and the sysfs
//! property name; gives its type; says whether the node's `properties` file
//! or its `mem_banks` supply it; and says how a restore GPU's value is
//! compared with the checkpoint's. From it come the struct, the conversions
//! to and from the image entry, the sysfs lookup ([`PROPERTIES`], read by the
//! sysfs parser) and the comparison ([`property_mismatch`], by the rules of the compat module).

use std::num::TryFromIntError;

use super::compat::{CompatChecks, Rule, Switch};
use super::{DeviceEntry, IoLink, dev_links};

/// Stores a value read from sysfs in one field; fails when the value does
/// not fit the field.
pub(super) type PropertySetter = fn(&mut GpuNode, u64) -> Result<(), TryFromIntError>;

/// One row of the property table, for the code that walks all properties.
pub(super) struct GpuProperty {
    /// Field name in [`GpuNode`] and [`DeviceEntry`], sysfs property name,
    /// and the name mismatch messages use.
    pub name: &'static str,
    /// Stores a value read from the node's `properties` file; `None` for
    /// values taken from `mem_banks`.
    pub set: Option<PropertySetter>,
    /// How a restore GPU's value is compared with the checkpoint's.
    pub rule: Rule,
    /// The value, widened for comparison and messages.
    pub get: fn(&GpuNode) -> u64,
}

/// How a property's type is stored in the image: as itself, or a flag as
/// 0 or 1.
trait EntryValue: Sized {
    type Entry;
    fn to_entry(self) -> Self::Entry;
    fn from_entry(entry: Self::Entry) -> Self;
}

/// Integers are stored as they are.
macro_rules! stored_as_is {
    ($($ty:ty),*) => {$(
        impl EntryValue for $ty {
            type Entry = $ty;
            fn to_entry(self) -> $ty {
                self
            }
            fn from_entry(entry: $ty) -> $ty {
                entry
            }
        }
    )*};
}

stored_as_is!(u32, u64);

impl EntryValue for bool {
    type Entry = u32;
    fn to_entry(self) -> u32 {
        u32::from(self)
    }
    fn from_entry(entry: u32) -> Self {
        entry != 0
    }
}

/// Generates [`GpuNode`], its image conversions and [`PROPERTIES`] from the
/// rows `name: type = source, rule;` where source is `properties` or
/// `mem_banks` and rule is `Equal`, `Ignored`, or `SameBits` / `AtLeast`
/// with the [`super::CompatChecks`] field and variable of its switch.
macro_rules! gpu_properties {
    (@set properties, $field:ident, $ty:ty) => {
        Some(|g: &mut GpuNode, value: u64| {
            g.$field = <$ty>::try_from(value)?;
            Ok(())
        })
    };
    (@set mem_banks, $field:ident, $ty:ty) => {
        None
    };
    ($(
        $(#[$doc:meta])*
        $field:ident: $ty:ty = $source:ident, $rule:ident $(($switch:ident, $var:literal))?;
    )*) => {
        /// A GPU node: the properties the plugin stores in the image and
        /// compares, in the order upstream compares them. Fields without a
        /// comment carry the sysfs property of the same name.
        #[derive(Clone, Debug, Default, PartialEq, Eq)]
        pub struct GpuNode {
            /// KFD node id (the directory name under `nodes/`).
            pub node_id: u32,
            /// KFD gpu id. Local (actual) id when parsed from sysfs; the user
            /// id when rebuilt from an image.
            pub gpu_id: u32,
            $( $(#[$doc])* pub $field: $ty, )*
            /// Links of kinds PCIe and XGMI, in numeric directory order.
            pub io_links: Vec<IoLink>,
        }

        /// Every property of [`GpuNode`], in comparison order.
        pub(super) const PROPERTIES: &[GpuProperty] = &[$(
            GpuProperty {
                name: stringify!($field),
                set: gpu_properties!(@set $source, $field, $ty),
                rule: Rule::$rule$((Switch { env_var: $var, on: |c| c.$switch }))?,
                get: |g| u64::from(g.$field),
            },
        )*];

        impl GpuNode {
            /// The image entry for this GPU, recorded under `image_gpu_id`
            /// (the user gpu id KFD reported for the process). Links are
            /// copied as they are.
            pub fn to_device_entry(&self, image_gpu_id: u32) -> DeviceEntry {
                DeviceEntry {
                    node_id: self.node_id,
                    gpu_id: image_gpu_id,
                    cpu_cores_count: 0,
                    gds_size_in_kb: 0,
                    $( $field: EntryValue::to_entry(self.$field), )*
                    iolinks: dev_links(&self.io_links),
                }
            }

            /// The GPU an image entry describes, with its kept links.
            pub(super) fn from_device_entry(d: &DeviceEntry, io_links: Vec<IoLink>) -> Self {
                Self {
                    node_id: d.node_id,
                    gpu_id: d.gpu_id,
                    $( $field: EntryValue::from_entry(d.$field), )*
                    io_links,
                }
            }
        }
    };
}

gpu_properties! {
    // Equal on both GPUs.
    simd_count: u32 = properties, Equal;
    mem_banks_count: u32 = properties, Equal;
    /// Raw `io_links_count` property (all links, valid or not).
    io_links_count: u32 = properties, Equal;
    max_waves_per_simd: u32 = properties, Equal;
    lds_size_in_kb: u32 = properties, Equal;
    wave_front_size: u32 = properties, Equal;
    array_count: u32 = properties, Equal;
    simd_arrays_per_engine: u32 = properties, Equal;
    cu_per_simd_array: u32 = properties, Equal;
    simd_per_cu: u32 = properties, Equal;
    max_slots_scratch_cu: u32 = properties, Equal;
    vendor_id: u32 = properties, Equal;
    device_id: u32 = properties, Equal;
    num_sdma_engines: u32 = properties, Equal;
    num_sdma_xgmi_engines: u32 = properties, Equal;
    num_sdma_queues_per_engine: u32 = properties, Equal;
    num_cp_queues: u32 = properties, Equal;
    /// True when the first frame-buffer bank is public (heap type 1).
    vram_public: bool = mem_banks, Equal;

    // Compared while their `KFD_*_CHECK` switch is on.
    capability: u32 = properties, SameBits(capability, "KFD_CAPABILITY_CHECK");
    /// Size of the first frame-buffer bank in bytes.
    vram_size: u64 = mem_banks, AtLeast(vram_size, "KFD_VRAM_SIZE_CHECK");
    num_gws: u32 = properties, AtLeast(num_gws, "KFD_NUM_GWS_CHECK");
    caches_count: u32 = properties, AtLeast(caches_count, "KFD_CACHES_COUNT_CHECK");
    fw_version: u32 = properties, AtLeast(fw_version, "KFD_FW_VER_CHECK");
    sdma_fw_version: u32 = properties, AtLeast(sdma_fw_version, "KFD_SDMA_FW_VER_CHECK");

    // Recorded, not compared.
    /// PCI domain (not compared).
    domain: u32 = properties, Ignored;
    /// Render-node minor (`/dev/dri/renderD<minor>`, not compared).
    drm_render_minor: u32 = properties, Ignored;
    /// XGMI hive id (not compared; hives come from the links).
    hive_id: u64 = properties, Ignored;
}

/// `device_properties_match`: the first property that rules `d` out for `s`,
/// in the order of the property table.
pub(super) fn property_mismatch(s: &GpuNode, d: &GpuNode, checks: &CompatChecks) -> Option<String> {
    PROPERTIES.iter().find_map(|p| {
        let (name, a, b) = (p.name, (p.get)(s), (p.get)(d));
        match p.rule {
            Rule::Equal if a != b => Some(format!("has {name} {b}, the checkpoint needs {a}")),
            Rule::SameBits(sw) if (sw.on)(checks) && a != b => Some(format!(
                "has {name} {b:#x}, the checkpoint needs {a:#x} ({})",
                sw.env_var
            )),
            Rule::AtLeast(sw) if (sw.on)(checks) && a > b => Some(format!(
                "has {name} {b}, the checkpoint needs at least {a} ({})",
                sw.env_var
            )),
            _ => None,
        }
    })
}
