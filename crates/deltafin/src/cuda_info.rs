//! What `deltafin info` says about CUDA devices: which one a GPU run would use and whether the
//! model's backbone fits in its memory (issue #16: "`deltafin info` says which device would be
//! used and how the memory plan splits").

use crate::size;

/// Prints the CUDA line(s) of `info`: the devices the driver reports (or the one-line reason
/// there are none) and, for `cuda:0`, the backbone against the device memory. `backbone` is the
/// resident backbone in bytes as the model would upload it; `record` one expert record's bytes.
pub fn print(backbone: u64, record: u64) {
    match deltafin_cuda::probe() {
        Err(e) => println!("CUDA                       {e}"),
        Ok(devices) => {
            for d in &devices {
                println!(
                    "CUDA                       cuda:{} {} (compute {}.{}), {}",
                    d.ordinal,
                    d.name,
                    d.compute_capability.0,
                    d.compute_capability.1,
                    size::human(d.total_bytes as u64)
                );
            }
            if let Some(d) = devices.first() {
                let total = d.total_bytes as u64;
                if backbone > total {
                    println!(
                        "CUDA memory plan (cuda:0)  the backbone ({}) does not fit in {}",
                        size::human(backbone),
                        size::human(total)
                    );
                } else {
                    let left = total - backbone;
                    let experts = left.saturating_sub(deltafin_engine::models::deepseek_v3_cuda::GPU_MARGIN_BYTES);
                    println!(
                        "CUDA memory plan (cuda:0)  backbone {}, {} reserved for KV cache and workspace, GPU expert cache {} (~{} records; --gpu-budget sets it; the free memory at start decides)",
                        size::human(backbone),
                        size::human(left - experts),
                        size::human(experts),
                        experts.checked_div(record.max(1)).unwrap_or(0)
                    );
                }
            }
        }
    }
}
