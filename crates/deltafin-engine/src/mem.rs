//! Process memory readings from `/proc/self/status` (Linux).

/// Reads a `kB` field of `/proc/self/status` (e.g. `VmHWM`, `VmRSS`) in bytes; None where
/// unavailable.
pub fn proc_status_bytes(field: &str) -> Option<u64> {
    kb_field("/proc/self/status", field)
}

/// Reads `FIELD:   N kB` from a `/proc` file, in bytes.
fn kb_field(file: &str, field: &str) -> Option<u64> {
    let s = std::fs::read_to_string(file).ok()?;
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

/// Reads a `kB` field of `/proc/meminfo` (e.g. `MemTotal`) in bytes.
pub fn meminfo_bytes(field: &str) -> Option<u64> {
    kb_field("/proc/meminfo", field)
}

/// The memory limit of this process's memory cgroup, bytes: cgroup v1 `memory.limit_in_bytes`
/// or v2 `memory.max`. None when unlimited or unreadable.
pub fn cgroup_memory_limit() -> Option<u64> {
    let groups = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    for line in groups.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        let path = path.trim_start_matches('/');
        let candidates: Vec<std::path::PathBuf> = if controllers.split(',').any(|c| c == "memory") {
            vec![std::path::Path::new("/sys/fs/cgroup/memory")
                .join(path)
                .join("memory.limit_in_bytes")]
        } else if controllers.is_empty() {
            vec![
                std::path::Path::new("/sys/fs/cgroup").join(path).join("memory.max"),
                std::path::Path::new("/sys/fs/cgroup/unified")
                    .join(path)
                    .join("memory.max"),
            ]
        } else {
            continue;
        };
        for c in candidates {
            if let Ok(v) = std::fs::read_to_string(&c) {
                let v = v.trim();
                if v == "max" {
                    continue;
                }
                if let Ok(n) = v.parse::<u64>() {
                    // cgroup v1 reports "unlimited" as a huge page-rounded number.
                    if n < (1u64 << 60) {
                        return Some(n);
                    }
                }
            }
        }
    }
    None
}
