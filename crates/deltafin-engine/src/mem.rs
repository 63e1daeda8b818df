//! Process memory readings from `/proc/self/status` (Linux).

/// Reads a `kB` field of `/proc/self/status` (e.g. `VmHWM`, `VmRSS`) in bytes; None where
/// unavailable.
pub fn proc_status_bytes(field: &str) -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    s.lines().find_map(|l| {
        let rest = l.strip_prefix(field)?.strip_prefix(':')?;
        let kb: u64 = rest.trim().trim_end_matches("kB").trim().parse().ok()?;
        Some(kb * 1024)
    })
}

/// Peak resident set size of this process (`VmHWM`), bytes.
pub fn peak_rss_bytes() -> Option<u64> {
    proc_status_bytes("VmHWM")
}

/// Current resident set size (`VmRSS`), bytes.
pub fn rss_bytes() -> Option<u64> {
    proc_status_bytes("VmRSS")
}
