//! Looking routed experts up for a GPU forward pass: hits from the GPU expert cache, misses
//! read through the CPU model's expert store and copied to the device (every family's GPU path).

use std::sync::Arc;

use deltafin_cuda::GpuMat;

use crate::gpu_experts::{GpuExpert, GpuExpertCache};

/// What [`fetch_gpu_experts`] changed in the cache, for device tables that name experts.
pub enum CacheChange<'a> {
    /// `(layer, expert)` became resident with these device weights.
    Inserted(usize, usize, &'a GpuExpert),
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
    use crate::EngineError;
    let cuda = |e: deltafin_cuda::CudaError| EngineError::Invalid(format!("CUDA: {e}"));
    let stand_in = routed.compute_only();
    let mut out: Vec<Option<GpuExpert>> = Vec::with_capacity(ids.len());
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
            let mats = [
                GpuMat::upload(gpu, &record.matrix(0)).map_err(cuda)?,
                GpuMat::upload(gpu, &record.matrix(1)).map_err(cuda)?,
                GpuMat::upload(gpu, &record.matrix(2)).map_err(cuda)?,
            ];
            let bytes: u64 = mats.iter().map(|m| m.nbytes() as u64).sum();
            cache.count_upload(bytes, t0.elapsed().as_nanos() as u64);
            let dev: GpuExpert = Arc::new(mats);
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
