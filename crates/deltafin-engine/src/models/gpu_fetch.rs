//! What every family's GPU path shares: opening the device with the backbone's size checked,
//! the GPU expert cache's budget, looking routed experts up for a forward pass (hits from the GPU
//! expert cache, misses read through the CPU model's expert store and copied to the device),
//! filling the cache at start, growing per-layer KV buffers, and the chunk pieces several
//! families compute alike (the device router's choice read back, the
//! per-expert path of a chunk's routed experts).

use std::sync::{Arc, Mutex, MutexGuard};

use deltafin_cuda::{CudaError, CudaSlice, Gpu, GpuBuf, GpuMat, RowCopy};

use deltafin_format::model_dir::{Backbone, MatHandle, VecHandle};
use deltafin_kernels::MatRef;

use crate::experts::{ExpertStore, HostPin};
use crate::gpu_experts::{GpuExpert, GpuExpertCache};
use crate::model::DecodeState;
use crate::moe::Routing;
use crate::EngineError;

/// A driver error as the engine's one-line error (`CUDA: …`).
pub fn cuda(e: CudaError) -> EngineError {
    EngineError::Invalid(format!("CUDA: {e}"))
}

/// Locks `m`, the GPU path's state named `what` (`"GPU expert cache"`, `"CUDA work buffers"`).
///
/// Errors: a lock poisoned by a panic while it was held (`<what> lock poisoned`).
pub fn lock<'a, T>(m: &'a Mutex<T>, what: &str) -> Result<MutexGuard<'a, T>, EngineError> {
    m.lock()
        .map_err(|_| EngineError::Invalid(format!("{what} lock poisoned")))
}

/// Device memory every family's GPU path leaves free by default beyond the backbone and the
/// GPU expert cache: KV caches, recurrent states, work buffers, CUDA graphs, bytes.
pub const GPU_MARGIN_BYTES: u64 = 2 << 30;

/// Opens `cuda:ordinal` for a model whose backbone takes `backbone` bytes, and page-locks the
/// record buffers of its expert store from now on ([`CudaHostPin`]) so that misses are copied
/// to the device by DMA straight from the buffer each read landed in.
///
/// Errors: no such device, or a driver failure; a backbone larger than the device's memory
/// (both sizes named: streaming backbone layers through the GPU is not there yet).
pub fn open_gpu_for(ordinal: usize, backbone: u64, store: &ExpertStore) -> Result<Arc<Gpu>, EngineError> {
    let gpu = Arc::new(Gpu::open(ordinal).map_err(|e| EngineError::Invalid(format!("CUDA: {e}")))?);
    let total = gpu.info().total_bytes as u64;
    if backbone > total {
        return Err(EngineError::Invalid(format!(
            "the backbone ({backbone} bytes) does not fit in cuda:{ordinal}'s {total} bytes"
        )));
    }
    store.set_host_pin(Arc::new(CudaHostPin(gpu.clone())));
    Ok(gpu)
}

/// Load-time uploads of backbone tensors to the device, looked up by checkpoint name (never in a
/// forward pass).
pub struct Upload<'a> {
    pub gpu: &'a Gpu,
    pub backbone: &'a Backbone,
}

impl Upload<'_> {
    /// The matrix `name`.
    ///
    /// Errors: a missing or malformed tensor (named); a driver failure.
    pub fn mat(&self, name: &str) -> Result<GpuMat, EngineError> {
        GpuMat::upload(self.gpu, &self.backbone.matrix(name)?).map_err(cuda)
    }

    /// The matrix a load-time handle names.
    ///
    /// Errors: a driver failure.
    pub fn mat_of(&self, h: &MatHandle) -> Result<GpuMat, EngineError> {
        self.matrix(&self.backbone.mat(h))
    }

    /// The vector a load-time handle names.
    ///
    /// Errors: a driver failure.
    pub fn vec_of(&self, h: &VecHandle) -> Result<GpuBuf, EngineError> {
        self.gpu.upload(self.backbone.vec(h)).map_err(cuda)
    }

    /// `m` (a view of this backbone, or of part of it).
    ///
    /// Errors: a driver failure.
    pub fn matrix(&self, m: &MatRef<'_>) -> Result<GpuMat, EngineError> {
        GpuMat::upload(self.gpu, m).map_err(cuda)
    }

    /// The f32 vector `name`.
    ///
    /// Errors: as [`Upload::mat`].
    pub fn vec(&self, name: &str) -> Result<GpuBuf, EngineError> {
        self.gpu.upload(self.backbone.vector(name)?).map_err(cuda)
    }
}

/// The expert store's [`HostPin`] on a CUDA device: `cuMemHostRegister` when a record buffer is
/// made, `cuMemHostUnregister` before it is unmapped. A buffer the driver refuses to lock (the
/// system's page-locked memory limit) stays pageable and is copied synchronously, as before.
pub struct CudaHostPin(pub Arc<Gpu>);

impl HostPin for CudaHostPin {
    unsafe fn pin(&self, ptr: *mut u8, len: usize) -> bool {
        // SAFETY: the caller keeps the range mapped until `unpin`.
        unsafe { self.0.register_host(ptr, len) }.is_ok()
    }

    unsafe fn unpin(&self, ptr: *mut u8) {
        // SAFETY: the caller guarantees no copy still reads it: the GPU path keeps the records
        // it copied until the stream has passed those copies (`GpuExpertCache::hold`).
        let _ = unsafe { self.0.unregister_host(ptr) };
    }
}

/// The GPU expert cache's byte budget once the backbone (`backbone` bytes) is on the device:
/// `requested` (`--gpu-budget`), or by default the free memory less [`GPU_MARGIN_BYTES`].
///
/// Errors: `requested` above the free memory (both named); a driver failure.
pub fn gpu_expert_budget(gpu: &Gpu, ordinal: usize, requested: Option<u64>, backbone: u64) -> Result<u64, EngineError> {
    let free = gpu
        .free_bytes()
        .map_err(|e| EngineError::Invalid(format!("CUDA: {e}")))?;
    match requested {
        Some(b) if b > free => Err(EngineError::Invalid(format!(
            "--gpu-budget {b} bytes: cuda:{ordinal} has {free} bytes free after the backbone ({backbone} bytes)"
        ))),
        Some(b) => Ok(b),
        None => Ok(free.saturating_sub(GPU_MARGIN_BYTES)),
    }
}

/// What [`fetch_gpu_experts`] changed in the cache, for device tables that name experts.
pub enum CacheChange<'a, T = GpuExpert> {
    /// `(layer, expert)` became resident with these device weights.
    Inserted(usize, usize, &'a T),
    /// `(layer, expert)` left the device.
    Evicted(usize, usize),
}

/// The device copies of routed experts `ids` of layer `l`, in that order: hits from `cache`,
/// misses fetched through `routed`'s expert store at once (one fetch, reads in file order, the
/// host cache as the tier below) and copied to the device as each record arrives; every
/// insertion and eviction is told to `on_change`. In compute-only measurement mode every id
/// stands for the layer's expert 0 (the CPU path's stand-in record). Every family's GPU path
/// looks its experts up here.
///
/// Errors: expert read or checksum failures; a driver error; the first error of `on_change`.
pub fn fetch_gpu_experts(
    gpu: &deltafin_cuda::Gpu,
    cache: &mut GpuExpertCache,
    routed: &crate::model::RoutedExperts,
    l: usize,
    ids: &[usize],
    on_change: &mut dyn FnMut(CacheChange) -> Result<(), crate::EngineError>,
) -> Result<Vec<GpuExpert>, crate::EngineError> {
    let upload = |record: &crate::experts::Expert| -> Result<(GpuExpert, u64), deltafin_cuda::CudaError> {
        let mats = [
            GpuMat::upload(gpu, &record.matrix(0))?,
            GpuMat::upload(gpu, &record.matrix(1))?,
            GpuMat::upload(gpu, &record.matrix(2))?,
        ];
        let bytes: u64 = mats.iter().map(|m| m.nbytes() as u64).sum();
        Ok((Arc::new(mats), bytes))
    };
    fetch_gpu_experts_with(gpu, cache, routed, l, ids, &upload, on_change)
}

/// Makes the device copy of an expert record: its handle and the device bytes it takes.
pub type UploadRecord<'a, T> = dyn Fn(&crate::experts::Expert) -> Result<(T, u64), deltafin_cuda::CudaError> + 'a;

/// [`fetch_gpu_experts`] with the device copy of a record made by `upload` (its handle and its
/// device bytes), for records that are not three matrices (gpt-oss: two matrices and their
/// f32 biases). Copies from page-locked record buffers run asynchronously on `gpu`'s stream: each
/// record copied is kept (with a mark of the stream after its copies) until the stream is past
/// that mark, so no buffer is reused while a copy still reads it.
///
/// Errors: expert read or checksum failures; the first error of `upload` or `on_change`.
pub fn fetch_gpu_experts_with<T: Clone>(
    gpu: &Gpu,
    cache: &mut GpuExpertCache<T>,
    routed: &crate::model::RoutedExperts,
    l: usize,
    ids: &[usize],
    upload: &UploadRecord<'_, T>,
    on_change: &mut dyn FnMut(CacheChange<'_, T>) -> Result<(), crate::EngineError>,
) -> Result<Vec<T>, crate::EngineError> {
    use crate::EngineError;
    let cuda = |e: deltafin_cuda::CudaError| EngineError::Invalid(format!("CUDA: {e}"));
    let stand_in = routed.compute_only();
    cache.release_copied().map_err(cuda)?;
    let mut out: Vec<Option<T>> = Vec::with_capacity(ids.len());
    let mut missing: Vec<usize> = Vec::new();
    for &e in ids {
        let e = if stand_in { 0 } else { e };
        let hit = cache.get(l, e);
        if hit.is_none() && !missing.contains(&e) {
            missing.push(e);
        }
        out.push(hit);
    }
    if !missing.is_empty() {
        for r in routed.store.fetch(l, &missing)? {
            let (i, record) = r?;
            let t0 = std::time::Instant::now();
            let uploaded = upload(&record);
            // Copies from a page-locked buffer run on after the call: the record is kept until
            // the stream has passed them, whether or not the upload succeeded.
            match gpu.mark() {
                Ok(mark) => cache.hold(mark, record),
                Err(e) => {
                    let _ = gpu.synchronize();
                    return Err(cuda(e));
                }
            }
            let (dev, bytes) = uploaded.map_err(cuda)?;
            cache.count_upload(bytes, t0.elapsed().as_nanos() as u64);
            // Buffers whose copies are done go back to the store for the reads still to come
            // (a prefill chunk fetches far more records than the store keeps buffers).
            cache.release_passed().map_err(cuda)?;
            let id = missing[i];
            for (el, ee) in cache.insert(l, id, dev.clone(), bytes) {
                on_change(CacheChange::Evicted(el, ee))?;
            }
            if cache.contains(l, id) {
                on_change(CacheChange::Inserted(l, id, &dev))?;
            }
            for (slot, &e) in out.iter_mut().zip(ids) {
                let e = if stand_in { 0 } else { e };
                if e == id && slot.is_none() {
                    *slot = Some(dev.clone());
                }
            }
        }
    }
    out.into_iter()
        .map(|e| e.ok_or_else(|| EngineError::Invalid(format!("layer {l}: an expert fetch ended early"))))
        .collect()
}

/// A KV cache in GPU memory: for every layer two buffers of positions, `[capacity, widths[0]]`
/// and `[capacity, widths[1]]` (MLA: the latent `c_kv` and the rope key `k_pe`; GQA: the
/// rotated, normed keys and the values); grows by doubling. Positions past `len` are stale and
/// overwritten by the next tokens, so truncating only moves `len`.
pub struct GpuLayerCache {
    gpu: Arc<Gpu>,
    widths: [usize; 2],
    layers: usize,
    /// `[kind][layer]`, each `[capacity * widths[kind]]` (empty until the first token).
    bufs: [Vec<GpuBuf>; 2],
    /// Positions held.
    pub len: usize,
    /// Positions every buffer has room for.
    pub capacity: usize,
}

impl GpuLayerCache {
    /// An empty cache of `layers` layers (no device memory until [`GpuLayerCache::reserve`]).
    pub fn new(gpu: Arc<Gpu>, layers: usize, widths: [usize; 2]) -> Self {
        Self {
            gpu,
            widths,
            layers,
            bufs: [Vec::new(), Vec::new()],
            len: 0,
            capacity: 0,
        }
    }

    /// Grows every buffer to hold at least `n` positions, keeping the first `len`.
    ///
    /// Errors: a driver failure (out of device memory).
    pub fn reserve(&mut self, n: usize) -> Result<(), CudaError> {
        if n <= self.capacity {
            return Ok(());
        }
        let cap = grown_capacity(n, self.capacity);
        for (bufs, width) in self.bufs.iter_mut().zip(self.widths) {
            grow_layer_bufs(&self.gpu, bufs, self.layers, width, self.len, cap)?;
        }
        self.capacity = cap;
        Ok(())
    }

    /// Layer `l`'s two buffers. Panics when nothing is reserved yet or `l` is out of range.
    pub fn layer(&self, l: usize) -> [&GpuBuf; 2] {
        [&self.bufs[0][l], &self.bufs[1][l]]
    }

    /// Layer `l`'s two buffers, to write. Panics as [`GpuLayerCache::layer`].
    pub fn layer_mut(&mut self, l: usize) -> [&mut GpuBuf; 2] {
        let [a, b] = &mut self.bufs;
        [&mut a[l], &mut b[l]]
    }

    /// Every buffer, the first kind's layers then the second's.
    pub fn buffers(&self) -> impl Iterator<Item = &GpuBuf> {
        self.bufs[0].iter().chain(&self.bufs[1])
    }
}

impl DecodeState for GpuLayerCache {
    fn len(&self) -> usize {
        self.len
    }

    fn truncate(&mut self, len: usize) -> bool {
        self.len = self.len.min(len);
        true
    }

    fn bytes(&self) -> usize {
        self.capacity * (self.widths[0] + self.widths[1]) * 4 * self.bufs[0].len()
    }

    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }
}

/// Positions a per-layer KV buffer holds after growing to fit `n` (capacity now `capacity`):
/// doubling, at least 64.
fn grown_capacity(n: usize, capacity: usize) -> usize {
    n.max(2 * capacity).max(64)
}

/// Replaces each of `layers` buffers of `bufs` (`[capacity, width]` each, or none yet) by one of
/// `[cap, width]` holding the first `len` positions of the old one (the rest zero).
///
/// Errors: a driver failure (out of device memory).
fn grow_layer_bufs(
    gpu: &Gpu,
    bufs: &mut Vec<GpuBuf>,
    layers: usize,
    width: usize,
    len: usize,
    cap: usize,
) -> Result<(), CudaError> {
    let mut grown = Vec::with_capacity(layers);
    for l in 0..layers {
        let mut nb = gpu.zeros(cap * width)?;
        if let Some(old) = bufs.get(l).filter(|_| len > 0) {
            let old = old.slice(..len * width);
            let mut dst = nb.slice_mut(..len * width);
            gpu.stream()
                .memcpy_dtod(&old, &mut dst)
                .map_err(|e| CudaError::Shape(format!("KV cache growth: {e}")))?;
        }
        grown.push(nb);
    }
    *bufs = grown;
    Ok(())
}

/// Fills a GPU expert cache at start (`--gpu-preload`): for each `(layer, n_experts)` of `layers`,
/// the layer's routed experts in file order (ascending id), 32 a fetch, while `room()` (records
/// that still fit in the budget) allows; `fetch(l, ids)` makes them resident and returns how many
/// it did. Returns the number of experts made resident.
///
/// Errors: the first error of `room` or `fetch`.
pub fn preload_in_file_order(
    layers: impl IntoIterator<Item = (usize, usize)>,
    mut room: impl FnMut() -> Result<usize, EngineError>,
    mut fetch: impl FnMut(usize, &[usize]) -> Result<usize, EngineError>,
) -> Result<usize, EngineError> {
    let mut n = 0;
    for (l, n_experts) in layers {
        for first in (0..n_experts).step_by(32) {
            let ids: Vec<usize> = (first..(first + 32).min(n_experts)).take(room()?).collect();
            if ids.is_empty() {
                return Ok(n);
            }
            n += fetch(l, &ids)?;
        }
    }
    Ok(n)
}

/// A chunk's routing grouped by expert (what expert-major MoE needs): the chosen experts'
/// `union` in ascending id, per union entry its `(token, slot)` pairs in token order, and for
/// every pair in that order (the "gathered order") its input row `src` (the token) and its output
/// row `dst = token * k + slot`.
pub struct ExpertMajor {
    pub union: Vec<usize>,
    pub members: Vec<Vec<(usize, usize)>>,
    pub src: Vec<i32>,
    pub dst: Vec<i32>,
}

impl ExpertMajor {
    /// Groups `routings` (one per token, `k` experts each).
    pub fn new(routings: &[crate::moe::Routing], k: usize) -> Self {
        let mut union: Vec<usize> = routings.iter().flat_map(|r| r.experts.iter().copied()).collect();
        union.sort_unstable();
        union.dedup();
        let mut members: Vec<Vec<(usize, usize)>> = vec![Vec::new(); union.len()];
        for (t, r) in routings.iter().enumerate() {
            for (slot, e) in r.experts.iter().enumerate() {
                if let Ok(u) = union.binary_search(e) {
                    members[u].push((t, slot));
                }
            }
        }
        let (mut src, mut dst) = (
            Vec::with_capacity(routings.len() * k),
            Vec::with_capacity(routings.len() * k),
        );
        for m in &members {
            for &(t, slot) in m {
                src.push(t as i32);
                dst.push((t * k + slot) as i32);
            }
        }
        ExpertMajor {
            union,
            members,
            src,
            dst,
        }
    }
}

/// The SwiGLU experts of a chunk, MXFP4 `[gate_proj, up_proj, down_proj]` each (`experts[u]` for
/// `em.union[u]`), in two grouped launches ([`Gpu::moe_grouped`]): `y[dst[p]] = down(silu(gate
/// xn[src[p]]) ⊙ up xn[src[p]])` for every pair `p`; `src_d` is `em.src` on the device, `xn:
/// [n, hidden]`, `y: [n * k, hidden]`. The bits of the per-expert matmuls.
///
/// Errors: `Shape` for experts of different shapes or layouts; a driver failure.
pub fn grouped_swiglu_experts(
    g: &Gpu,
    experts: &[&[GpuMat; 3]],
    em: &ExpertMajor,
    src_d: &CudaSlice<i32>,
    xn: &GpuBuf,
    y: &mut GpuBuf,
) -> Result<(), CudaError> {
    let Some(first) = experts.first() else {
        return Ok(());
    };
    let (inter, hidden, pairs) = (first[0].rows, first[0].cols, em.dst.len());
    let mut table = g.expert_table(experts.len(), inter, hidden)?;
    table.set(g, 0, experts)?;
    // tiles[i] = [entry, first pair, pairs]: each expert's pairs, `tmax` at a time.
    let shape = g.grouped_shape(&table);
    let tmax = shape.tokens;
    let mut tiles = Vec::with_capacity(pairs / tmax + experts.len());
    let mut off = 0usize;
    for (u, m) in em.members.iter().enumerate() {
        for t0 in (0..m.len()).step_by(tmax) {
            tiles.push([u as i32, (off + t0) as i32, (m.len() - t0).min(tmax) as i32]);
        }
        off += m.len();
    }
    let mut xg = g.zeros(pairs * hidden)?;
    g.copy_rows(RowCopy::Gather, xn, src_d, 0, pairs, hidden, &mut xg)?;
    let mut hh = g.zeros(pairs * inter)?;
    g.moe_grouped(shape, &table, &tiles, &xg, &em.dst, &mut hh, y)
}

/// The device router's choice for `n` tokens of MoE layer `l` read back: `ids_d`, `w_d`
/// `[n, k]` (router order) → one [`Routing`] a token.
///
/// Errors: an id outside `0..n_experts` (non-finite router logits), naming the layer; a driver
/// failure.
pub fn download_routings(
    g: &Gpu,
    l: usize,
    ids_d: &CudaSlice<i32>,
    w_d: &GpuBuf,
    k: usize,
    n_experts: usize,
) -> Result<Vec<Routing>, EngineError> {
    let ids = g.download(ids_d).map_err(cuda)?;
    let weights = g.download(w_d).map_err(cuda)?;
    if let Some(&bad) = ids.iter().find(|&&e| e < 0 || e as usize >= n_experts) {
        return Err(EngineError::Invalid(format!(
            "layer {l}: the device router chose expert {bad} (non-finite router logits?)"
        )));
    }
    Ok(ids
        .chunks(k)
        .zip(weights.chunks(k))
        .map(|(i, w)| Routing {
            experts: i.iter().map(|&e| e as usize).collect(),
            weights: w.to_vec(),
        })
        .collect())
}

/// The per-expert path of a chunk's routed experts: for each expert of `em.union` (`experts[u]`,
/// its matrices), its tokens' rows of `xn: [n, hidden]` gathered, `expert(matrices, rows, count)`
/// applied, and the result scattered into its (token, slot) rows of `y: [n * k, hidden]`;
/// `src_d` is `em.src` on the device.
///
/// Errors: what `expert` returns; a driver failure.
pub fn per_expert_rows<E>(
    g: &Gpu,
    experts: &[E],
    em: &ExpertMajor,
    src_d: &CudaSlice<i32>,
    (xn, hidden): (&GpuBuf, usize),
    y: &mut GpuBuf,
    mut expert: impl FnMut(&E, &GpuBuf, usize) -> Result<GpuBuf, CudaError>,
) -> Result<(), CudaError> {
    let dst_d = g.upload(&em.dst)?;
    let mut off = 0;
    for (e, m) in experts.iter().zip(&em.members) {
        let rows = m.len();
        let mut xe = g.zeros(rows * hidden)?;
        g.copy_rows(RowCopy::Gather, xn, src_d, off, rows, hidden, &mut xe)?;
        let ye = expert(e, &xe, rows)?;
        g.copy_rows(RowCopy::Scatter, &ye, &dst_d, off, rows, hidden, y)?;
        off += rows;
    }
    Ok(())
}
