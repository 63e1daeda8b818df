//! Where a model computes: `--device cpu | cuda[:N] | auto` (issue #16).

use std::fmt;
use std::str::FromStr;

use deltafin_format::{ModelConfig, ModelDir};

use crate::experts::StoreOptions;
use crate::model::{load_model, CausalLm, FiniteLogits};
use crate::EngineError;

/// A compute device as the user names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    /// The CPU kernels (the default).
    Cpu,
    /// CUDA device `N` (`cuda` alone is `cuda:0`).
    Cuda(usize),
    /// `cuda:0` when a CUDA device is present and the model's family runs there; otherwise the
    /// CPU, with a note on stderr saying why.
    Auto,
}

impl FromStr for Device {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "cpu" => Ok(Device::Cpu),
            "auto" => Ok(Device::Auto),
            "cuda" => Ok(Device::Cuda(0)),
            _ => match s.strip_prefix("cuda:").map(str::parse::<usize>) {
                Some(Ok(n)) => Ok(Device::Cuda(n)),
                _ => Err(format!("{s:?}: expected cpu, cuda, cuda:N or auto")),
            },
        }
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
            Device::Auto => f.write_str("auto"),
        }
    }
}

/// GPU placement options (`--gpu-budget`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GpuOptions {
    /// Bytes of device memory for routed experts (the GPU expert cache); `None`: what the
    /// device has free after the backbone, less a margin for the KV cache and work buffers.
    pub budget: Option<u64>,
    /// Read every routed expert into the GPU expert cache at load, in file order, until the
    /// budget is full (`--gpu-preload`): decode then starts with the experts on the device, as
    /// an all-on-GPU engine does, at the cost of reading the pack once at start.
    pub preload: bool,
}

/// Why `config`'s family cannot run on CUDA yet, or `None` when it can (DeepSeek-V3 / Kimi K2,
/// Kimi Linear / Kimi K3, Qwen3-MoE, Mixtral, gpt-oss; a configuration of those the GPU path does not
/// take is refused at load with its own line).
pub fn cuda_unsupported(config: &ModelConfig) -> Option<String> {
    match config {
        ModelConfig::DeepseekV3(_)
        | ModelConfig::KimiLinear(_)
        | ModelConfig::Qwen3Moe(_)
        | ModelConfig::Mixtral(_)
        | ModelConfig::GptOss(_) => None,
        other => Some(format!(
            "the {} family does not run on CUDA yet (DeepSeek-V3 / Kimi K2, Kimi Linear / Kimi K3, Qwen3-MoE, Mixtral and gpt-oss do); use --device cpu",
            other.family()
        )),
    }
}

/// Loads the model in `dir` on `device` (see [`load_model`] for the CPU). Returns the model and
/// the device it runs on (`Auto` resolved).
///
/// Errors: everything [`load_model`] refuses; for CUDA, a family not on the GPU yet (one line
/// naming it, never a silent fallback), no driver or device, a backbone larger than the device.
pub fn load_model_on(
    dir: &ModelDir,
    opts: StoreOptions,
    device: Device,
    gpu: GpuOptions,
) -> Result<(Box<dyn CausalLm>, Device), EngineError> {
    let config = &dir.manifest.config;
    let device = match device {
        Device::Auto => match (deltafin_cuda::probe(), cuda_unsupported(config)) {
            (Ok(_), None) => Device::Cuda(0),
            (Err(e), _) => {
                eprintln!("note: --device auto: computing on the CPU ({e})");
                Device::Cpu
            }
            (Ok(_), Some(why)) => {
                eprintln!("note: --device auto: computing on the CPU ({why})");
                Device::Cpu
            }
        },
        d => d,
    };
    match device {
        Device::Cuda(n) => {
            if let Some(why) = cuda_unsupported(config) {
                return Err(EngineError::Invalid(format!("--device {device}: {why}")));
            }
            let on_device = |e: EngineError| EngineError::Invalid(format!("--device {device}: {e}"));
            let m: Box<dyn CausalLm> = match config {
                ModelConfig::KimiLinear(_) => {
                    Box::new(crate::models::KimiLinearCuda::load_with(dir, opts, n, gpu).map_err(on_device)?)
                }
                ModelConfig::Qwen3Moe(_) | ModelConfig::Mixtral(_) | ModelConfig::GptOss(_) => {
                    Box::new(crate::models::GqaCuda::load_with(dir, opts, n, gpu).map_err(on_device)?)
                }
                _ => Box::new(crate::models::DeepseekV3Cuda::load_with(dir, opts, n, gpu).map_err(on_device)?),
            };
            Ok((Box::new(FiniteLogits(m)), device))
        }
        _ => {
            if let Some(b) = gpu.budget {
                return Err(EngineError::Invalid(format!(
                    "--gpu-budget {b}: the model computes on the CPU (give --device cuda)"
                )));
            }
            if gpu.preload {
                return Err(EngineError::Invalid(
                    "--gpu-preload: the model computes on the CPU (give --device cuda)".into(),
                ));
            }
            Ok((load_model(dir, opts)?, Device::Cpu))
        }
    }
}

impl From<deltafin_cuda::CudaError> for EngineError {
    /// A CUDA failure as an engine error (one line, prefixed `CUDA:`).
    fn from(e: deltafin_cuda::CudaError) -> Self {
        EngineError::Invalid(format!("CUDA: {e}"))
    }
}
