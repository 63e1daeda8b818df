//! Finding CUDA devices without panicking on machines that have none.

use crate::CudaError;
use cudarc::driver::{result, sys};

/// One CUDA device as the driver reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Device ordinal (`cuda:N`).
    pub ordinal: usize,
    /// Marketing name, e.g. "NVIDIA H200".
    pub name: String,
    /// Compute capability (major, minor), e.g. (9, 0) for Hopper.
    pub compute_capability: (i32, i32),
    /// Device memory in bytes.
    pub total_bytes: usize,
    /// Streaming multiprocessors (sizes the grids of the persistent kernels).
    pub multiprocessors: u32,
    /// Most shared memory one block may use, in bytes, once it opts in
    /// (`CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN`: 227 KiB on Hopper, 99 KiB on
    /// Ada); the kernels that stage a tile in shared memory are used only where it fits.
    pub shared_bytes_optin: usize,
}

/// Lists the CUDA devices, or says in one line why there are none.
///
/// Safe on any machine: checks that `libcuda` can be loaded before calling into it (cudarc's
/// loader panics otherwise), then `cuInit`.
///
/// # Errors
/// [`CudaError::Unavailable`] naming the reason: no driver library, `cuInit` failed, no device.
pub fn probe() -> Result<Vec<DeviceInfo>, CudaError> {
    // SAFETY: only tries to dlopen the driver library by its usual names.
    if !unsafe { sys::is_culib_present() } {
        return Err(CudaError::Unavailable(
            "the CUDA driver library (libcuda.so) is not installed".into(),
        ));
    }
    result::init().map_err(|e| CudaError::Unavailable(format!("cuInit failed: {e}")))?;
    let n = result::device::get_count().map_err(|e| CudaError::Unavailable(format!("cuDeviceGetCount failed: {e}")))?;
    if n <= 0 {
        return Err(CudaError::Unavailable("the driver reports no CUDA device".into()));
    }
    (0..n as usize).map(info).collect()
}

fn info(ordinal: usize) -> Result<DeviceInfo, CudaError> {
    let unavailable =
        |what: &str, e: result::DriverError| CudaError::Unavailable(format!("cuda:{ordinal}: {what} failed: {e}"));
    let dev = result::device::get(ordinal as i32).map_err(|e| unavailable("cuDeviceGet", e))?;
    // SAFETY: `dev` is a valid device handle from cuDeviceGet after cuInit.
    let (name, total, major, minor, sms, smem) = unsafe {
        let name = result::device::get_name(dev).map_err(|e| unavailable("cuDeviceGetName", e))?;
        let total = result::device::total_mem(dev).map_err(|e| unavailable("cuDeviceTotalMem", e))?;
        let major = result::device::get_attribute(
            dev,
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
        )
        .map_err(|e| unavailable("cuDeviceGetAttribute", e))?;
        let minor = result::device::get_attribute(
            dev,
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
        )
        .map_err(|e| unavailable("cuDeviceGetAttribute", e))?;
        let sms = result::device::get_attribute(dev, sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| unavailable("cuDeviceGetAttribute", e))?;
        let smem = result::device::get_attribute(
            dev,
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
        )
        .map_err(|e| unavailable("cuDeviceGetAttribute", e))?;
        (name, total, major, minor, sms, smem)
    };
    Ok(DeviceInfo {
        ordinal,
        name,
        compute_capability: (major, minor),
        total_bytes: total,
        multiprocessors: sms.max(1) as u32,
        shared_bytes_optin: smem.max(0) as usize,
    })
}
