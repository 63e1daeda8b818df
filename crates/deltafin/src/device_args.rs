//! `--device` and `--gpu-budget`, the same for `run`, `chat` and `serve` (issue #16).

use anyhow::Result;
use deltafin_engine::experts::StoreOptions;
use deltafin_engine::{load_model_on, CausalLm, Device, GpuOptions};
use deltafin_format::ModelDir;

/// Where a model computes and how much device memory its routed experts may take.
#[derive(clap::Args, Clone, Debug)]
pub(crate) struct DeviceArgs {
    /// Where to compute: `cpu` (the default), `cuda` or `cuda:N` (DeepSeek-V3 / Kimi K2, Kimi
    /// Linear / Kimi K3, Qwen3-MoE and Mixtral so far; other families are refused), or `auto` (cuda:0 when a CUDA
    /// device is present and the family runs there, else the CPU, with a note saying why).
    #[arg(long, default_value = "cpu", value_parser = parse_device)]
    pub device: Device,
    /// With a GPU: device memory for routed experts (the GPU expert cache, above the host cache
    /// of --ram-budget), e.g. 8GiB (default: what the device has free after the backbone, less
    /// 2 GiB for the KV cache and work buffers).
    #[arg(long, value_parser = crate::size::parse_size, allow_hyphen_values = true)]
    pub gpu_budget: Option<u64>,
    /// With a GPU: read every routed expert into the GPU expert cache at start, until the
    /// budget is full (decode then starts with its experts on the device; start-up reads the
    /// pack once).
    #[arg(long)]
    pub gpu_preload: bool,
}

fn parse_device(s: &str) -> Result<Device, String> {
    s.parse()
}

impl DeviceArgs {
    /// Loads the model in `dir` on the chosen device and says on stderr when it is not the CPU.
    ///
    /// Errors: as [`load_model_on`] (a family not on the GPU yet, no device, a backbone or
    /// `--gpu-budget` larger than the device).
    pub(crate) fn load(&self, dir: &ModelDir, store: StoreOptions) -> Result<Box<dyn CausalLm>> {
        let (model, device) = load_model_on(
            dir,
            store,
            self.device,
            GpuOptions {
                budget: self.gpu_budget,
                preload: self.gpu_preload,
            },
        )?;
        if device != Device::Cpu {
            match model.gpu_cache_stats() {
                Some(s) => eprintln!(
                    "computing on {device} (GPU expert cache {:.2} GiB)",
                    s.budget_bytes as f64 / (1u64 << 30) as f64
                ),
                None => eprintln!("computing on {device}"),
            }
        }
        Ok(model)
    }
}
