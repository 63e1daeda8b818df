//! Byte sizes on the command line: `4096`, `512K`, `512KiB`, `1.5G`, `2GiB` (binary multiples:
//! K = KiB = 1024, as llama.cpp and most memory flags read them).

/// Parses a byte size. Errors name the offending text.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num
        .parse()
        .map_err(|_| format!("invalid size {s:?}: expected a number with an optional unit (e.g. 512MiB, 4G)"))?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        other => {
            return Err(format!(
                "invalid size {s:?}: unknown unit {other:?} (use B, K, M, G, T)"
            ))
        }
    };
    let v = n * mult as f64;
    if !v.is_finite() || v < 0.0 || v > u64::MAX as f64 {
        return Err(format!("invalid size {s:?}"));
    }
    Ok(v as u64)
}

/// Formats bytes with a binary unit, e.g. `12.3 MiB`.
pub fn human(b: u64) -> String {
    const U: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut i = 0;
    while v >= 1024.0 && i < U.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", U[i])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("512K"), Ok(512 << 10));
        assert_eq!(parse_size("512MiB"), Ok(512 << 20));
        assert_eq!(parse_size("1.5G"), Ok(3 << 29));
        assert_eq!(parse_size("0"), Ok(0));
        assert!(parse_size("lots").unwrap_err().contains("lots"));
        assert!(parse_size("5X").is_err());
        assert_eq!(human(1536), "1.5 KiB");
    }
}
