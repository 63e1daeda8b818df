//! Heap buffers with a chosen alignment (4 KiB for records read with O_DIRECT, and so that f32
//! and bf16 views of stored tensors are always aligned).

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ptr::NonNull;

/// A zero-initialised, fixed-size byte buffer aligned to `align` bytes.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
    layout: Layout,
}

// SAFETY: AlignedBuf owns its allocation exclusively, like Vec<u8>.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared access only hands out &[u8].
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// Allocates `len` zeroed bytes aligned to `align` (a power of two). Aborts on allocation
    /// failure like `Vec`. Panics if `align` is not a power of two (a programming error).
    pub fn zeroed(len: usize, align: usize) -> Self {
        let layout = Layout::from_size_align(len.max(1), align).expect("alignment must be a power of two");
        // SAFETY: layout has non-zero size.
        let p = unsafe { alloc_zeroed(layout) };
        let ptr = match NonNull::new(p) {
            Some(p) => p,
            None => std::alloc::handle_alloc_error(layout),
        };
        AlignedBuf { ptr, len, layout }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr is valid for len initialised (zeroed) bytes for the lifetime of self.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and &mut self guarantees exclusivity.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed` with this layout.
        unsafe { dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AlignedBuf({} bytes, align {})", self.len, self.layout.align())
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
