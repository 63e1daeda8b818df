//! Where a model computes: `--device cpu | cuda[:N] | auto` (issue #16).

use std::fmt;
use std::str::FromStr;

use deltafin_format::{ModelConfig, ModelDir};

use crate::experts::StoreOptions;
use crate::model::{load_model, CausalLm};
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

/// Why `config`'s family cannot run on CUDA yet, or `None` when it can (DeepSeek-V3 / Kimi K2).
pub fn cuda_unsupported(config: &ModelConfig) -> Option<String> {
    match config {
        ModelConfig::DeepseekV3(_) => None,
        other => Some(format!(
            "the {} family does not run on CUDA yet (DeepSeek-V3 / Kimi K2 do); use --device cpu",
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
            let m = crate::models::DeepseekV3Cuda::load_with(dir, opts, n)
                .map_err(|e| EngineError::Invalid(format!("--device {device}: {e}")))?;
            Ok((Box::new(m), device))
        }
        _ => Ok((load_model(dir, opts)?, Device::Cpu)),
    }
}
