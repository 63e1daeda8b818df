//! Device-resident weight matrices and their products.

use crate::gpu::{GpuBuf, TOKEN_TILE, WARPS};

/// Threads of an x-stationary block, rows per pass and tokens per tile (must match `ops.cu`).
const XS_THREADS: u32 = 256;
const XS_ROWS: u32 = 4;
const XS_TOKENS: u32 = 2;
/// The pipelined matvec's warps a block, stage width (MX blocks) and stages (`ops.cu`).
const MVP_WARPS: u32 = 8;
/// Warps a block of the lean matvec (`MVL_WARPS` in ops.cu).
const MVL_WARPS: u32 = 8;
const MVP_CH: u32 = 32;
const MVP_S: u32 = 4;
/// Warps of a block of the staged int8 kernels (`__launch_bounds__(128, …)` in ops.cu).
const STAGED_WARPS: u32 = 4;
/// Most passes of a staged block's warps over its rows (a block covers at most this many times
/// `4 × rows_per_warp` rows, so staging its tile is paid once for up to 256 rows).
const STAGED_MAX_PASSES: usize = 8;
/// Fewest tokens for which [`Kernel::best_for`] takes the staged int8 kernel: it computes all 8
/// tokens of a tile whatever `n`, where `int8_mm_r4` skips the absent ones.
const STAGED_MIN_TOKENS: usize = TOKEN_TILE as usize;
use crate::{CudaError, DeviceInfo, DriverContext, Gpu};
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use deltafin_kernels::{MatData, MatRef};

/// A weight matrix `W: [rows, cols]` in device memory (rows = output features), in the layouts
/// of `deltafin_kernels::MatData`.
pub struct GpuMat {
    /// Output features.
    pub rows: usize,
    /// Input features.
    pub cols: usize,
    /// The stored weights.
    pub data: GpuMatData,
}

/// Device storage of a [`GpuMat`].
pub enum GpuMatData {
    /// `[rows * cols]` f32 (bf16 and f16 sources are widened exactly to f32 on upload).
    F32(CudaSlice<f32>),
    /// Per-row symmetric int8: codes `[rows * cols]`, scales `[rows]`.
    Int8 {
        /// Codes.
        q: CudaSlice<i8>,
        /// One f32 scale per row.
        scales: CudaSlice<f32>,
    },
    /// MXFP4, Hugging Face layout: `packed: [rows * 16 * ceil(cols/32)]`,
    /// `scales: [rows * ceil(cols/32)]` E8M0 bytes.
    Mxfp4 {
        /// Two E2M1 codes per byte, element 2i in the low nibble.
        packed: CudaSlice<u8>,
        /// One E8M0 byte per 32-element block.
        scales: CudaSlice<u8>,
    },
}

/// How the MXFP4 kernels decode E2M1 codes (`ops.cu`, `Dec<N>`). Every decoder gives the same
/// bits; they differ only in speed (`examples/gemv_bench.rs`, bench/NOTES.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decode {
    /// The table in `__constant__` memory (the first version: lanes reading different entries
    /// serialize). Matrix-vector with one row a warp only.
    ConstTable,
    /// The table in shared memory. Matrix-vector with one row a warp only.
    SharedTable,
    /// Codes built into f16 bit patterns and widened exactly (every shape and form).
    F16Bits,
    /// Codes looked up by byte permutes and turned into floats by an add (`Dec<3>`: no
    /// conversion unit, every shape and form).
    BytePermute,
    /// Half the codes as [`Decode::F16Bits`] (conversion unit), half by byte permutes
    /// (integer unit), so neither pipe alone bounds the decode (`Dec<4>`). Matrix-vector at 1
    /// and 2 rows a warp and the pipelined kernels; matrix-matrix at 2 rows a warp.
    Mixed,
}

/// Which kernel runs a product: the E2M1 decoder (MXFP4 only), how many consecutive rows one
/// warp computes (each x load then serves that many rows), and for int8 matmul whether the
/// token tile is staged in shared memory. The result's bits do not depend on the choice (except
/// `stationary_x`, see there).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Kernel {
    /// E2M1 decoder (ignored for int8 and f32).
    pub decode: Decode,
    /// Rows per warp: 1, 2 or 4 (f32 always uses 1; ignored with `stationary_x`); 4 or 8 with
    /// `staged`.
    pub rows_per_warp: u32,
    /// MXFP4 only: the x-stationary kernels (`mxfp4_xs_*`: a block of 256 threads keeps x in
    /// registers and streams rows through with 16-byte loads; up to 16,384 columns). Their
    /// reduction order differs from the one-warp-a-row kernels, so this choice changes bits;
    /// matvec and matmul with the same choice still agree bit for bit.
    pub stationary_x: bool,
    /// MXFP4 matrix-vector only: the pipelined kernels (`mxfp4_mvp_*`: each warp streams its
    /// rows' codes and scales through a 4-stage shared-memory ring with `cp.async`, so three
    /// stages of 512 bytes a row are in flight; persistent warps). Same bits as every other
    /// matvec. Needs `cols % 128 == 0`; 1, 2 or 4 rows a warp (4 with [`Decode::Mixed`] only).
    pub pipelined: bool,
    /// int8 matmul only: the staged kernels (`int8_mm_staged_*` in ops.cu): a block of 4 warps
    /// copies its tile of 8 tokens (every column) into shared memory once and each warp computes
    /// `rows_per_warp` rows (8, or 4) for all 8 tokens, so one 16-byte load of x serves 8 rows.
    /// Same bits as the other int8 kernels. Needs `cols % 16 == 0` and
    /// `8 × ceil(cols / 32) × 144` bytes of shared memory a block
    /// ([`Kernel::staged_shared_bytes`]).
    pub staged: bool,
    /// MXFP4 matrix-vector only: the lean kernels (`mxfp4_mvl_*` in ops.cu: the one-warp-a-row
    /// lane mapping and order with the bookkeeping out of the inner loop: block scales from a
    /// shared table, running row offsets, weights loaded past L1, persistent warps). Same bits
    /// as every other matvec. Needs `cols % 32 == 0` and [`Decode::F16Bits`]; 1, 2 or 4 rows a
    /// warp.
    pub lean: bool,
}

impl Kernel {
    /// The fastest kernel measured on the H200 for this format and form (bench/NOTES.md, "CUDA
    /// kernels"): MXFP4 f16-bits decode (the fused launches' `MX_DEC`) at 1 row a warp for
    /// matvec and 2 for matmul; int8 at 4.
    pub fn best(data: &GpuMatData, matmul: bool) -> Self {
        let rows_per_warp = match (data, matmul) {
            (GpuMatData::Mxfp4 { .. }, false) => 1,
            (GpuMatData::Mxfp4 { .. }, true) => 2,
            (GpuMatData::Int8 { .. }, _) => 4,
            (GpuMatData::F32(_), _) => 1,
        };
        Self {
            decode: Decode::F16Bits,
            rows_per_warp,
            stationary_x: false,
            pipelined: false,
            staged: false,
            lean: false,
        }
    }

    /// The kernel [`GpuMat::matvec`] runs for `m` on device `info`: for MXFP4 with `cols % 32 ==
    /// 0` and at least `32 ×` multiprocessors rows (a block of the lean kernel's 8 warps × 4
    /// rows for every SM), the lean kernel at 4 rows a warp (`mxfp4_mvl_r4`: 57 % of a copy on
    /// [65,536, 7,168] on the H200 against the one-row kernel's 31 %, bench/NOTES.md); otherwise
    /// [`Kernel::best`]. Every choice gives the same bits.
    pub fn best_matvec(m: &GpuMat, info: &DeviceInfo) -> Self {
        let lean = Self {
            rows_per_warp: 4,
            lean: true,
            ..Self::best(&m.data, false)
        };
        match &m.data {
            GpuMatData::Mxfp4 { .. } if m.cols.is_multiple_of(32) && m.rows >= 32 * info.multiprocessors as usize => {
                lean
            }
            _ => Self::best(&m.data, false),
        }
    }

    /// The kernel [`GpuMat::matmul`] runs for `n` tokens of `m` on device `info`: the staged int8
    /// kernel at 8 rows a warp when `m` is int8, `n >= 8` (one full tile: it computes all 8
    /// tokens of a tile whatever `n`) and its shape allows it (`cols % 16 == 0`, and the staged
    /// tile fits two blocks an SM in shared memory: `int8_mm_staged_r8t8b2`'s registers are
    /// capped for two, and one block of 4 warps an SM would leave each scheduler one warp);
    /// otherwise [`Kernel::best`]'s matmul choice (`int8_mm_r4` for int8).
    pub fn best_for(m: &GpuMat, n: usize, info: &DeviceInfo) -> Self {
        let staged = Self {
            rows_per_warp: 8,
            staged: true,
            ..Self::best(&m.data, true)
        };
        // Each block also holds 1 KiB the system reserves; an SM has the opt-in limit plus that.
        let fits = |bytes: usize| 2 * (bytes + 1024) <= info.shared_bytes_optin + 1024;
        match (&m.data, Self::staged_shared_bytes(m.cols)) {
            (GpuMatData::Int8 { .. }, Some(bytes)) if n >= STAGED_MIN_TOKENS && fits(bytes) => staged,
            _ => Self::best(&m.data, true),
        }
    }

    /// Dynamic shared memory of a staged int8 block for `cols` columns, bytes: the tile's 8
    /// tokens, each 32 columns padded to 36 floats (`SX` in ops.cu); `None` when `cols % 16 != 0`
    /// (the staged kernels' 16-byte loads of codes and x need it).
    pub fn staged_shared_bytes(cols: usize) -> Option<usize> {
        cols.is_multiple_of(16)
            .then(|| TOKEN_TILE as usize * cols.div_ceil(32) * 36 * 4)
    }

    /// MX blocks of x each of the 256 threads of an x-stationary kernel holds.
    fn x_blocks_per_thread(&self, cols: usize) -> Option<usize> {
        match cols.div_ceil(32).div_ceil(XS_THREADS as usize) {
            n @ (1 | 2) => Some(n),
            _ => None,
        }
    }

    fn name(&self, data: &GpuMatData, matmul: bool, cols: usize) -> Result<&'static str, CudaError> {
        let r = self.rows_per_warp;
        if self.staged {
            return match (data, matmul, r, self.stationary_x) {
                (GpuMatData::Int8 { .. }, true, 8, false) => Ok("int8_mm_staged_r8t8b2"),
                (GpuMatData::Int8 { .. }, true, 4, false) => Ok("int8_mm_staged_r4t8b3"),
                _ => Err(CudaError::Shape(format!(
                    "no staged kernel for {self:?} ({}; int8 matmul at 4 or 8 rows a warp only)",
                    if matmul { "matmul" } else { "matvec" }
                ))),
            };
        }
        if self.stationary_x {
            return match (data, matmul, self.x_blocks_per_thread(cols)) {
                (GpuMatData::Mxfp4 { .. }, false, Some(1)) => Ok("mxfp4_xs_np1_t1"),
                (GpuMatData::Mxfp4 { .. }, false, Some(2)) => Ok("mxfp4_xs_np2_t1"),
                (GpuMatData::Mxfp4 { .. }, true, Some(1)) => Ok("mxfp4_xs_np1_t2"),
                (GpuMatData::Mxfp4 { .. }, true, Some(2)) => Ok("mxfp4_xs_np2_t2"),
                _ => Err(CudaError::Shape(format!(
                    "no x-stationary kernel for {cols} columns of this format (MXFP4 up to 16,384)"
                ))),
            };
        }
        if self.lean {
            let ok = !matmul && matches!(data, GpuMatData::Mxfp4 { .. }) && cols.is_multiple_of(32);
            return match (ok, self.decode, r) {
                (true, Decode::F16Bits, 1) => Ok("mxfp4_mvl_r1"),
                (true, Decode::F16Bits, 2) => Ok("mxfp4_mvl_r2"),
                (true, Decode::F16Bits, 4) => Ok("mxfp4_mvl_r4"),
                _ => Err(CudaError::Shape(format!(
                    "no lean kernel for {self:?} on {cols} columns (MXFP4 matvec, f16 bits, cols % 32 == 0)"
                ))),
            };
        }
        if self.pipelined {
            let refused = || {
                CudaError::Shape(format!(
                    "no pipelined kernel for {self:?} on {cols} columns (MXFP4 matvec, cols % 128 == 0)"
                ))
            };
            if matmul || !matches!(data, GpuMatData::Mxfp4 { .. }) || !cols.is_multiple_of(128) {
                return Err(refused());
            }
            return match (self.decode, r) {
                (Decode::F16Bits, 1) => Ok("mxfp4_mvp_f16_r1"),
                (Decode::F16Bits, 2) => Ok("mxfp4_mvp_f16_r2"),
                (Decode::BytePermute, 1) => Ok("mxfp4_mvp_prmt_r1"),
                (Decode::BytePermute, 2) => Ok("mxfp4_mvp_prmt_r2"),
                (Decode::Mixed, 1) => Ok("mxfp4_mvp_mix_r1"),
                (Decode::Mixed, 2) => Ok("mxfp4_mvp_mix_r2"),
                (Decode::Mixed, 4) => Ok("mxfp4_mvp_mix_r4"),
                _ => Err(refused()),
            };
        }
        let name = match (data, matmul, self.decode, r) {
            (GpuMatData::F32(_), false, _, _) => "f32_matvec",
            (GpuMatData::F32(_), true, _, _) => "f32_matmul",
            (GpuMatData::Int8 { .. }, false, _, 1) => "int8_mv_r1",
            (GpuMatData::Int8 { .. }, false, _, 2) => "int8_mv_r2",
            (GpuMatData::Int8 { .. }, false, _, 4) => "int8_mv_r4",
            (GpuMatData::Int8 { .. }, true, _, 1) => "int8_mm_r1",
            (GpuMatData::Int8 { .. }, true, _, 2) => "int8_mm_r2",
            (GpuMatData::Int8 { .. }, true, _, 4) => "int8_mm_r4",
            (GpuMatData::Mxfp4 { .. }, false, Decode::ConstTable, 1) => "mxfp4_mv_const_r1",
            (GpuMatData::Mxfp4 { .. }, false, Decode::SharedTable, 1) => "mxfp4_mv_lds_r1",
            (GpuMatData::Mxfp4 { .. }, false, Decode::F16Bits, 1) => "mxfp4_mv_f16_r1",
            (GpuMatData::Mxfp4 { .. }, false, Decode::F16Bits, 2) => "mxfp4_mv_f16_r2",
            (GpuMatData::Mxfp4 { .. }, false, Decode::F16Bits, 4) => "mxfp4_mv_f16_r4",
            (GpuMatData::Mxfp4 { .. }, true, Decode::F16Bits, 1) => "mxfp4_mm_f16_r1",
            (GpuMatData::Mxfp4 { .. }, true, Decode::F16Bits, 2) => "mxfp4_mm_f16_r2",
            (GpuMatData::Mxfp4 { .. }, true, Decode::F16Bits, 4) => "mxfp4_mm_f16_r4",
            (GpuMatData::Mxfp4 { .. }, false, Decode::BytePermute, 1) => "mxfp4_mv_prmt_r1",
            (GpuMatData::Mxfp4 { .. }, false, Decode::BytePermute, 2) => "mxfp4_mv_prmt_r2",
            (GpuMatData::Mxfp4 { .. }, false, Decode::BytePermute, 4) => "mxfp4_mv_prmt_r4",
            (GpuMatData::Mxfp4 { .. }, true, Decode::BytePermute, 1) => "mxfp4_mm_prmt_r1",
            (GpuMatData::Mxfp4 { .. }, true, Decode::BytePermute, 2) => "mxfp4_mm_prmt_r2",
            (GpuMatData::Mxfp4 { .. }, true, Decode::BytePermute, 4) => "mxfp4_mm_prmt_r4",
            (GpuMatData::Mxfp4 { .. }, false, Decode::Mixed, 1) => "mxfp4_mv_mix_r1",
            (GpuMatData::Mxfp4 { .. }, false, Decode::Mixed, 2) => "mxfp4_mv_mix_r2",
            (GpuMatData::Mxfp4 { .. }, true, Decode::Mixed, 2) => "mxfp4_mm_mix_r2",
            _ => {
                return Err(CudaError::Shape(format!(
                    "no {} kernel for {self:?}",
                    if matmul { "matmul" } else { "matvec" }
                )))
            }
        };
        Ok(name)
    }

    fn rows_per_block(&self, data: &GpuMatData) -> u32 {
        match data {
            GpuMatData::F32(_) => WARPS,
            _ => WARPS * self.rows_per_warp,
        }
    }
}

impl GpuMat {
    /// Copies a host matrix to the device.
    ///
    /// # Errors
    /// `Shape` when a dimension exceeds `i32::MAX` (the kernels index with 32-bit ints); a
    /// driver error (out of memory, ...).
    pub fn upload(gpu: &Gpu, m: &MatRef) -> Result<Self, CudaError> {
        if m.rows > i32::MAX as usize || m.cols > i32::MAX as usize || m.rows == 0 || m.cols == 0 {
            return Err(CudaError::Shape(format!(
                "matrix [{}, {}] is empty or too large for the CUDA kernels",
                m.rows, m.cols
            )));
        }
        let data = match m.data {
            MatData::F32(w) => GpuMatData::F32(gpu.upload(w)?),
            MatData::Bf16(w) => GpuMatData::F32(gpu.upload(&w.iter().map(|v| v.to_f32()).collect::<Vec<_>>())?),
            MatData::F16(w) => GpuMatData::F32(gpu.upload(&w.iter().map(|v| v.to_f32()).collect::<Vec<_>>())?),
            MatData::Int8 { q, scales } => GpuMatData::Int8 {
                q: gpu.upload(q)?,
                scales: gpu.upload(scales)?,
            },
            MatData::Mxfp4 { packed, scales } => GpuMatData::Mxfp4 {
                packed: gpu.upload(packed)?,
                scales: gpu.upload(scales)?,
            },
        };
        Ok(Self {
            rows: m.rows,
            cols: m.cols,
            data,
        })
    }

    /// Bytes of device memory the weights take.
    pub fn nbytes(&self) -> usize {
        match &self.data {
            GpuMatData::F32(w) => w.num_bytes(),
            GpuMatData::Int8 { q, scales } => q.num_bytes() + scales.num_bytes(),
            GpuMatData::Mxfp4 { packed, scales } => packed.num_bytes() + scales.num_bytes(),
        }
    }

    fn check(&self, what: &str, x: &GpuBuf, n: usize, y: &GpuBuf) -> Result<(), CudaError> {
        let (xl, yl) = (n.checked_mul(self.cols), n.checked_mul(self.rows));
        if n == 0 || xl != Some(x.len()) || yl != Some(y.len()) || n > i32::MAX as usize {
            return Err(CudaError::Shape(format!(
                "{what}: [{}, {}] matrix with {n} token(s) wants x of {} and y of {} elements, got {} and {}",
                self.rows,
                self.cols,
                n.saturating_mul(self.cols),
                n.saturating_mul(self.rows),
                x.len(),
                y.len()
            )));
        }
        Ok(())
    }

    /// `y = W x` with `x: [cols]`, `y: [rows]` with [`Kernel::best_matvec`] (fixed reduction
    /// order: see `ops.cu`).
    ///
    /// # Errors
    /// `Shape` when lengths disagree; a driver error.
    pub fn matvec(&self, gpu: &Gpu, x: &GpuBuf, y: &mut GpuBuf) -> Result<(), CudaError> {
        self.launch(gpu, Kernel::best_matvec(self, gpu.info()), x, 1, false, y)
    }

    /// [`GpuMat::matvec`] with the kernel chosen.
    ///
    /// # Errors
    /// As [`GpuMat::matvec`], and `Shape` for a combination with no kernel.
    pub fn matvec_with(&self, gpu: &Gpu, kernel: Kernel, x: &GpuBuf, y: &mut GpuBuf) -> Result<(), CudaError> {
        self.launch(gpu, kernel, x, 1, false, y)
    }

    /// `Y = X Wᵀ` for `n` tokens: `x: [n, cols]`, `y: [n, rows]`; the weights are decoded once
    /// per tile of 8 tokens, and each token's row is bit-identical to [`GpuMat::matvec`] of that
    /// token (the expert-major form used for prefill and speculative verification), with
    /// [`Kernel::best_for`].
    ///
    /// # Errors
    /// `Shape` when lengths disagree; a driver error.
    pub fn matmul(&self, gpu: &Gpu, x: &GpuBuf, n: usize, y: &mut GpuBuf) -> Result<(), CudaError> {
        self.launch(gpu, Kernel::best_for(self, n, gpu.info()), x, n, true, y)
    }

    /// [`GpuMat::matmul`] with the kernel chosen.
    ///
    /// # Errors
    /// As [`GpuMat::matmul`], and `Shape` for a combination with no kernel.
    pub fn matmul_with(
        &self,
        gpu: &Gpu,
        kernel: Kernel,
        x: &GpuBuf,
        n: usize,
        y: &mut GpuBuf,
    ) -> Result<(), CudaError> {
        self.launch(gpu, kernel, x, n, true, y)
    }

    fn launch(
        &self,
        gpu: &Gpu,
        kernel: Kernel,
        x: &GpuBuf,
        n: usize,
        matmul: bool,
        y: &mut GpuBuf,
    ) -> Result<(), CudaError> {
        self.check(if matmul { "matmul" } else { "matvec" }, x, n, y)?;
        let f = gpu.k.get(kernel.name(&self.data, matmul, self.cols)?)?;
        let tiles = if matmul { (n as u32).div_ceil(TOKEN_TILE) } else { 1 };
        if tiles > 65_535 {
            return Err(CudaError::Shape(format!(
                "matmul: {n} tokens is more than one launch takes"
            )));
        }
        if kernel.staged {
            return self.launch_staged(gpu, f, kernel, x, n, y);
        }
        let cfg = if kernel.pipelined && !kernel.stationary_x {
            // Persistent warps, each with its own ring of MVP_S stages (ops.cu).
            let r = kernel.rows_per_warp;
            let smem = MVP_WARPS * MVP_S * r * (MVP_CH * 16 + MVP_CH);
            if smem as usize > gpu.info().shared_bytes_optin {
                return Err(CudaError::Shape(format!(
                    "pipelined matvec at {r} rows a warp wants {smem} bytes of shared memory; the device has {}",
                    gpu.info().shared_bytes_optin
                )));
            }
            let attr = cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
            f.set_attribute(attr, smem as i32).ctx("cuFuncSetAttribute")?;
            let groups = (self.rows as u32).div_ceil(r);
            let per_sm = (gpu.info().shared_bytes_optin as u32 / smem).clamp(1, 8);
            LaunchConfig {
                grid_dim: (
                    groups.div_ceil(MVP_WARPS).min(gpu.info().multiprocessors * per_sm),
                    1,
                    1,
                ),
                block_dim: (32 * MVP_WARPS, 1, 1),
                shared_mem_bytes: smem,
            }
        } else if kernel.lean {
            // Persistent warps over row groups, at most 8 blocks of 8 warps an SM.
            let groups = (self.rows as u32).div_ceil(kernel.rows_per_warp);
            LaunchConfig {
                grid_dim: (groups.div_ceil(MVL_WARPS).min(gpu.info().multiprocessors * 8), 1, 1),
                block_dim: (32 * MVL_WARPS, 1, 1),
                shared_mem_bytes: 0,
            }
        } else if kernel.stationary_x {
            // Persistent over rows: a few blocks per multiprocessor, each streaming row groups.
            let groups = (self.rows as u32).div_ceil(XS_ROWS);
            let tiles = if matmul { (n as u32).div_ceil(XS_TOKENS) } else { 1 };
            LaunchConfig {
                grid_dim: (groups.min(gpu.info().multiprocessors * 4), tiles, 1),
                block_dim: (XS_THREADS, 1, 1),
                shared_mem_bytes: 0,
            }
        } else {
            LaunchConfig {
                grid_dim: ((self.rows as u32).div_ceil(kernel.rows_per_block(&self.data)), tiles, 1),
                block_dim: (32 * WARPS, 1, 1),
                shared_mem_bytes: 0,
            }
        };
        let (rows, cols, n_i) = (self.rows as i32, self.cols as i32, n as i32);
        let mut b = gpu.stream().launch_builder(f);
        match &self.data {
            GpuMatData::Mxfp4 { packed, scales } => b.arg(packed).arg(scales),
            GpuMatData::Int8 { q, scales } => b.arg(q).arg(scales),
            GpuMatData::F32(w) => b.arg(w),
        };
        b.arg(&rows).arg(&cols).arg(x);
        if matmul || !matches!(self.data, GpuMatData::F32(_)) {
            b.arg(&n_i);
        }
        b.arg(y);
        // SAFETY: the arguments follow the kernel's signature in ops.cu (weights, rows, cols, x,
        // n except for f32_matvec, y); lengths were checked against the shape above.
        unsafe { b.launch(cfg) }.ctx("launch matrix kernel")?;
        Ok(())
    }

    /// Launches `int8_mm_staged_*` (see [`Kernel::staged`]): blocks of 4 warps over
    /// (row blocks of [`staged_cta_rows`] rows, tiles of 8 tokens), the tile's staged inputs as
    /// dynamic shared memory.
    fn launch_staged(
        &self,
        gpu: &Gpu,
        f: &cudarc::driver::CudaFunction,
        kernel: Kernel,
        x: &GpuBuf,
        n: usize,
        y: &mut GpuBuf,
    ) -> Result<(), CudaError> {
        let GpuMatData::Int8 { q, scales } = &self.data else {
            return Err(CudaError::Shape("staged matmul: int8 matrices only".into()));
        };
        let optin = gpu.info().shared_bytes_optin;
        let smem = match Kernel::staged_shared_bytes(self.cols) {
            None => {
                return Err(CudaError::Shape(format!(
                    "staged matmul: [{}, {}] has cols % 16 != 0 (no 16-byte loads)",
                    self.rows, self.cols
                )))
            }
            Some(b) if b > optin => {
                return Err(CudaError::Shape(format!(
                    "staged matmul: [{}, {}] needs {b} bytes of shared memory a block; this device allows {optin}",
                    self.rows, self.cols
                )))
            }
            Some(b) => b,
        };
        let tiles = n.div_ceil(TOKEN_TILE as usize); // at most 65,535: checked by the caller
        let pass = (STAGED_WARPS * kernel.rows_per_warp) as usize;
        let cta_rows = staged_cta_rows(self.rows, tiles, pass, gpu.info().multiprocessors as usize);
        let cfg = LaunchConfig {
            grid_dim: (self.rows.div_ceil(cta_rows) as u32, tiles as u32, 1),
            block_dim: (32 * STAGED_WARPS, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        let attr = cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
        f.set_attribute(attr, smem as i32)
            .ctx("cuFuncSetAttribute (staged int8)")?;
        let (rows, cols, cta, n_i) = (self.rows as i32, self.cols as i32, cta_rows as i32, n as i32);
        let mut b = gpu.stream().launch_builder(f);
        b.arg(q)
            .arg(scales)
            .arg(&rows)
            .arg(&cols)
            .arg(&cta)
            .arg(x)
            .arg(&n_i)
            .arg(y);
        // SAFETY: the arguments follow `int8_mm_staged_*` in ops.cu (q, scales, rows, cols,
        // cta_rows, x, n, y); lengths were checked against the shape, cols % 16 == 0 (16-byte
        // aligned rows of codes and of x), and the shared memory is what the kernel indexes
        // (8 tokens × ceil(cols / 32) × 36 floats), allowed above.
        unsafe { b.launch(cfg) }.ctx("launch staged int8 matmul")?;
        Ok(())
    }
}

/// Rows a block of the staged int8 kernels covers: whole passes of its warps (`pass` rows each),
/// at most [`STAGED_MAX_PASSES`], fewer where the grid would otherwise have under 4 blocks an SM
/// (few tokens or rows), and balanced so that the row blocks differ by at most one pass.
fn staged_cta_rows(rows: usize, tiles: usize, pass: usize, sms: usize) -> usize {
    let passes = rows.div_ceil(pass);
    let per_block = (passes * tiles).div_ceil(4 * sms.max(1)).clamp(1, STAGED_MAX_PASSES);
    let blocks = passes.div_ceil(per_block);
    passes.div_ceil(blocks) * pass
}
