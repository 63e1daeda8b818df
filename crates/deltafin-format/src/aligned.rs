//! Page-aligned buffers for expert records and the backbone, and the alignments of the model
//! directory's tensors and records.
//!
//! Each buffer is its own anonymous memory map, returned to the kernel when dropped. Records are
//! hundreds of KiB to tens of MiB and are freed from reader threads other than the ones that
//! allocated them; with malloc that pattern fragments per-thread arenas and resident memory
//! creeps far above the cache budget (measured: 70 MiB peak for a 15 MiB budget on the demo).
//! Separate maps keep resident memory equal to the bytes actually held. Page alignment (4 KiB)
//! also satisfies O_DIRECT and every f32/bf16 view of stored tensors.

/// Alignment of each expert record in `experts.pack`, bytes.
pub const RECORD_ALIGN: u64 = 4096;
/// Alignment of each tensor in `backbone.bin`, bytes.
pub const TENSOR_ALIGN: u64 = 64;

/// A zero-initialised, fixed-size, page-aligned byte buffer.
pub struct AlignedBuf {
    map: Option<memmap2::MmapMut>,
}

impl AlignedBuf {
    /// Allocates `len` zeroed bytes aligned to at least `align` bytes (a power of two, at most
    /// the page size, 4096).
    ///
    /// Panics if `align` exceeds 4096 (a programming error) or if the kernel refuses the
    /// mapping (out of memory, as `Vec` aborts).
    pub fn zeroed(len: usize, align: usize) -> Self {
        assert!(
            align.is_power_of_two() && align <= 4096,
            "alignment {align} unsupported"
        );
        if len == 0 {
            return AlignedBuf { map: None };
        }
        let map = memmap2::MmapMut::map_anon(len).unwrap_or_else(|e| panic!("cannot allocate {len} bytes: {e}"));
        AlignedBuf { map: Some(map) }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.map.as_ref().map_or(0, |m| m.len())
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        self.map.as_deref().unwrap_or(&[])
    }

    /// The bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        self.map.as_deref_mut().unwrap_or(&mut [])
    }
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AlignedBuf({} bytes)", self.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_and_zeroed() {
        for align in [64, 4096] {
            let mut b = AlignedBuf::zeroed(10_000, align);
            assert_eq!(b.as_slice().as_ptr() as usize % align, 0);
            assert!(b.as_slice().iter().all(|&x| x == 0));
            b.as_mut_slice()[9_999] = 7;
            assert_eq!(b.as_slice()[9_999], 7);
        }
        assert!(AlignedBuf::zeroed(0, 64).is_empty());
    }
}
