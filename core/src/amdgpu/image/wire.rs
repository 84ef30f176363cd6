//! Allocation-free walk over a proto2 payload that checks the presence of
//! required fields, recursing into the sub-messages the schema declares.
//!
//! protobuf-c refuses a message that lacks a `required` field; prost fills in
//! a default instead. Running this walk before prost keeps our reader as
//! strict as the C plugin's (so a file of another message type, or an empty
//! payload, is refused) and rejects malformed wire data before prost
//! allocates anything for it.

use super::model::FormatError;

/// One field of a message, as far as the presence check is concerned.
#[derive(Debug)]
pub struct FieldRule {
    /// Field number.
    pub tag: u32,
    /// Field name in the schema, for error messages.
    pub name: &'static str,
    /// Whether the field must be present.
    pub required: bool,
    /// Rules for the sub-message held by a message-typed field.
    pub nested: Option<&'static MessageRules>,
}

/// Presence rules of one message type.
#[derive(Debug)]
pub struct MessageRules {
    /// Message name in the schema.
    pub name: &'static str,
    /// Fields with rules; unlisted fields are skipped. At most 64.
    pub fields: &'static [FieldRule],
}

const fn req(tag: u32, name: &'static str) -> FieldRule {
    FieldRule {
        tag,
        name,
        required: true,
        nested: None,
    }
}

const fn opt(tag: u32, name: &'static str) -> FieldRule {
    FieldRule {
        tag,
        name,
        required: false,
        nested: None,
    }
}

const fn repeated(tag: u32, name: &'static str, nested: &'static MessageRules) -> FieldRule {
    FieldRule {
        tag,
        name,
        required: false,
        nested: Some(nested),
    }
}

pub(crate) static DEV_IOLINK: MessageRules = MessageRules {
    name: "dev_iolink",
    fields: &[req(1, "type"), req(2, "node_to_id")],
};

pub(crate) static KFD_DEVICE_ENTRY: MessageRules = MessageRules {
    name: "kfd_device_entry",
    fields: &[
        req(1, "node_id"),
        req(2, "gpu_id"),
        req(3, "cpu_cores_count"),
        req(4, "simd_count"),
        req(5, "mem_banks_count"),
        req(6, "caches_count"),
        req(7, "io_links_count"),
        req(8, "max_waves_per_simd"),
        req(9, "lds_size_in_kb"),
        req(10, "gds_size_in_kb"),
        req(11, "num_gws"),
        req(12, "wave_front_size"),
        req(13, "array_count"),
        req(14, "simd_arrays_per_engine"),
        req(15, "cu_per_simd_array"),
        req(16, "simd_per_cu"),
        req(17, "max_slots_scratch_cu"),
        req(18, "vendor_id"),
        req(19, "device_id"),
        req(20, "domain"),
        req(21, "drm_render_minor"),
        req(22, "hive_id"),
        req(23, "num_sdma_engines"),
        req(24, "num_sdma_xgmi_engines"),
        req(25, "num_sdma_queues_per_engine"),
        req(26, "num_cp_queues"),
        req(27, "fw_version"),
        req(28, "capability"),
        req(29, "sdma_fw_version"),
        req(30, "vram_public"),
        req(31, "vram_size"),
        repeated(32, "iolinks", &DEV_IOLINK),
    ],
};

pub(crate) static KFD_BO_ENTRY: MessageRules = MessageRules {
    name: "kfd_bo_entry",
    fields: &[
        req(1, "addr"),
        req(2, "size"),
        req(3, "offset"),
        req(4, "alloc_flags"),
        req(5, "gpu_id"),
        // Absent from CRIU v4.2 images.
        opt(6, "handle"),
    ],
};

pub(crate) static CRIU_KFD: MessageRules = MessageRules {
    name: "criu_kfd",
    fields: &[
        req(1, "pid"),
        req(2, "num_of_gpus"),
        req(3, "num_of_cpus"),
        repeated(4, "device_entries", &KFD_DEVICE_ENTRY),
        req(5, "num_of_bos"),
        repeated(6, "bo_entries", &KFD_BO_ENTRY),
        req(7, "num_of_objects"),
        req(8, "shared_mem_size"),
        req(9, "shared_mem_magic"),
        req(10, "priv_data"),
    ],
};

pub(crate) static DRM_VM_ENTRY: MessageRules = MessageRules {
    name: "drm_vm_entry",
    fields: &[
        req(1, "addr"),
        req(2, "size"),
        req(3, "offset"),
        req(4, "flags"),
    ],
};

pub(crate) static DRM_BO_ENTRY: MessageRules = MessageRules {
    name: "drm_bo_entry",
    fields: &[
        req(1, "addr"),
        req(2, "size"),
        req(3, "offset"),
        req(4, "alloc_flags"),
        req(5, "alignment"),
        req(6, "preferred_domains"),
        req(7, "handle"),
        req(8, "is_import"),
        req(9, "num_of_vms"),
        repeated(10, "vm_entries", &DRM_VM_ENTRY),
    ],
};

pub(crate) static CRIU_RENDER_NODE: MessageRules = MessageRules {
    name: "criu_render_node",
    fields: &[
        req(1, "gpu_id"),
        // Absent from CRIU v4.2 images; all-or-none is checked after decoding.
        opt(2, "id"),
        opt(3, "drm_render_minor"),
        opt(4, "num_of_bos"),
        repeated(5, "bo_entries", &DRM_BO_ENTRY),
    ],
};

pub(crate) static CRIU_DMABUF_NODE: MessageRules = MessageRules {
    name: "criu_dmabuf_node",
    fields: &[req(1, "gem_handle")],
};

const WIRE_VARINT: u64 = 0;
const WIRE_FIXED64: u64 = 1;
const WIRE_LEN: u64 = 2;
const WIRE_FIXED32: u64 = 5;

fn malformed(rules: &MessageRules, detail: &'static str) -> FormatError {
    FormatError::Malformed {
        message: rules.name,
        detail,
    }
}

/// Reads a base-128 varint at `*pos`, advancing it.
fn read_varint(buf: &[u8], pos: &mut usize) -> Option<u64> {
    let mut value = 0u64;
    for shift in (0..64).step_by(7) {
        let byte = *buf.get(*pos)?;
        *pos += 1;
        value |= u64::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            // The tenth byte may only carry the top bit of a u64.
            if shift == 63 && byte > 1 {
                return None;
            }
            return Some(value);
        }
    }
    None
}

/// Advances `*pos` by `n` bytes if that many are left.
fn advance(buf: &[u8], pos: &mut usize, n: u64) -> Option<()> {
    let left = (buf.len() - *pos) as u64;
    if n > left {
        return None;
    }
    *pos += n as usize;
    Some(())
}

/// Checks that `buf` is well-formed proto2 wire data in which every required
/// field of `rules` (and of the sub-messages it describes) is present.
pub fn check_required(buf: &[u8], rules: &MessageRules) -> Result<(), FormatError> {
    debug_assert!(rules.fields.len() <= 64);
    let mut seen = 0u64;
    let mut pos = 0usize;
    while pos < buf.len() {
        let key = read_varint(buf, &mut pos).ok_or_else(|| malformed(rules, "bad field key"))?;
        let wire_type = key & 7;
        let tag = key >> 3;
        if tag == 0 || tag > u64::from(u32::MAX >> 3) {
            return Err(malformed(rules, "invalid field number"));
        }
        let rule = rules.fields.iter().position(|f| u64::from(f.tag) == tag);
        if let Some(i) = rule {
            seen |= 1 << i;
        }
        match wire_type {
            WIRE_VARINT => {
                read_varint(buf, &mut pos).ok_or_else(|| malformed(rules, "bad varint"))?;
            }
            WIRE_FIXED64 => {
                advance(buf, &mut pos, 8).ok_or_else(|| malformed(rules, "truncated fixed64"))?;
            }
            WIRE_FIXED32 => {
                advance(buf, &mut pos, 4).ok_or_else(|| malformed(rules, "truncated fixed32"))?;
            }
            WIRE_LEN => {
                let len = read_varint(buf, &mut pos)
                    .ok_or_else(|| malformed(rules, "bad length prefix"))?;
                let start = pos;
                advance(buf, &mut pos, len)
                    .ok_or_else(|| malformed(rules, "length-delimited field runs past the end"))?;
                if let Some(nested) = rule.and_then(|i| rules.fields[i].nested) {
                    check_required(&buf[start..pos], nested)?;
                }
            }
            // Groups (3, 4) are not used by the schema and protobuf-c does
            // not accept them either; 6 and 7 are not wire types.
            _ => return Err(malformed(rules, "unsupported wire type")),
        }
    }
    for (i, field) in rules.fields.iter().enumerate() {
        if field.required && seen & (1 << i) == 0 {
            return Err(FormatError::MissingField {
                message: rules.name,
                field: field.name,
            });
        }
    }
    Ok(())
}
