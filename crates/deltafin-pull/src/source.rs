//! Where a source's files live: a URL, or a Hugging Face repository id resolved against a hub
//! endpoint as `huggingface_hub` resolves it (`{endpoint}/{org}/{name}/resolve/{revision}/{file}`).

/// The public Hugging Face Hub: the endpoint of repository ids unless `--endpoint` or
/// `HF_ENDPOINT` names another (the variable `huggingface_hub` reads).
pub const DEFAULT_ENDPOINT: &str = "https://huggingface.co";

/// The hub endpoint: `flag`, else the `HF_ENDPOINT` environment variable, else
/// [`DEFAULT_ENDPOINT`]; without a trailing slash.
pub fn hub_endpoint(flag: Option<&str>) -> String {
    let env = std::env::var("HF_ENDPOINT").ok();
    let e = flag
        .or(env.as_deref())
        .map(str::trim)
        .filter(|e| !e.is_empty())
        .unwrap_or(DEFAULT_ENDPOINT);
    e.trim_end_matches('/').to_string()
}

/// Whether `s` is a Hugging Face repository id `org/name` (the hub's rule: letters, digits,
/// `-`, `_`, `.`; at most 96 characters each; no `..` and no leading or trailing `-` or `.`).
fn is_repo_id(s: &str) -> bool {
    let part = |p: &str| {
        !p.is_empty()
            && p.len() <= 96
            && p.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
            && !p.contains("..")
            && !p.starts_with(['-', '.'])
            && !p.ends_with(['-', '.'])
    };
    matches!(s.split_once('/'), Some((org, name)) if part(org) && part(name))
}

/// A repository: `<url>/resolve/<revision>/<file>` (the Hugging Face layout), or with `flat`
/// `<url>/<file>` (any HTTP(S) server or object store serving the files).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Source {
    /// Repository URL without a trailing slash.
    pub url: String,
    pub revision: String,
    pub flat: bool,
}

impl Source {
    /// A source; `revision` defaults to `main`.
    ///
    /// Errors: a URL that is not `http://` or `https://`.
    pub fn new(url: &str, revision: Option<&str>, flat: bool) -> Result<Self, crate::PullError> {
        if !(url.starts_with("http://") || url.starts_with("https://")) {
            return Err(crate::PullError::Invalid(format!(
                "source {url:?} must be an http:// or https:// URL (a repository: files at <url>/resolve/<revision>/<file>, or <url>/<file> with --flat)"
            )));
        }
        Ok(Source {
            url: url.trim_end_matches('/').to_string(),
            revision: revision.unwrap_or("main").to_string(),
            flat,
        })
    }

    /// A source as `deltafin pull` takes it: an `http://` or `https://` URL, or a Hugging Face
    /// repository id `org/name[@revision]` at `endpoint` (its files at
    /// `{endpoint}/{org}/{name}/resolve/{revision}/{file}`). `revision` (`--revision`) defaults
    /// to `main`.
    ///
    /// Errors: neither a URL nor a repository id; a revision given twice, differently; `flat`
    /// or an empty revision with a repository id; an endpoint that is not an http(s) URL.
    pub fn parse(spec: &str, endpoint: &str, revision: Option<&str>, flat: bool) -> Result<Self, crate::PullError> {
        let invalid = |m: String| Err(crate::PullError::Invalid(m));
        if spec.starts_with("http://") || spec.starts_with("https://") {
            return Self::new(spec, revision, flat);
        }
        let (repo, at) = match spec.split_once('@') {
            Some((r, v)) => (r, Some(v)),
            None => (spec, None),
        };
        if !is_repo_id(repo) {
            let local = if std::path::Path::new(spec).exists() {
                " (a local directory converts with `deltafin convert`)"
            } else {
                ""
            };
            return invalid(format!(
                "source {spec:?} is neither an http:// or https:// URL nor a Hugging Face repository id org/name[@revision]{local}"
            ));
        }
        let rev = match (at, revision) {
            (Some(a), Some(r)) if a != r => {
                return invalid(format!("{spec:?} names revision {a:?} and --revision {r:?}: give one"))
            }
            (Some(a), _) => a,
            (None, r) => r.unwrap_or("main"),
        };
        if rev.is_empty() || rev.chars().any(|c| c.is_control() || c.is_whitespace()) {
            return invalid(format!("{spec:?}: the revision must be a branch, tag or commit"));
        }
        if flat {
            return invalid(format!(
                "--flat applies to URLs; {repo} is a Hugging Face repository id (files at <endpoint>/{repo}/resolve/<revision>/<file>)"
            ));
        }
        if !(endpoint.starts_with("http://") || endpoint.starts_with("https://")) {
            return invalid(format!(
                "endpoint {endpoint:?} (--endpoint or HF_ENDPOINT) must be an http:// or https:// URL"
            ));
        }
        Self::new(&format!("{}/{repo}", endpoint.trim_end_matches('/')), Some(rev), false)
    }

    /// URL of `file` in the repository. A revision holding `/` (`refs/pr/1`) is sent
    /// percent-encoded, as the hub expects.
    pub fn file_url(&self, file: &str) -> String {
        if self.flat {
            format!("{}/{file}", self.url)
        } else {
            format!("{}/resolve/{}/{file}", self.url, self.revision.replace('/', "%2F"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts() {
        let s = Source::new("http://h/org/m/", None, false).unwrap();
        assert_eq!(s.file_url("config.json"), "http://h/org/m/resolve/main/config.json");
        let s = Source::new("https://h/x", Some("abc"), true).unwrap();
        assert_eq!(s.file_url("a.safetensors"), "https://h/x/a.safetensors");
        assert!(Source::new("/local/dir", None, false).is_err());
    }

    #[test]
    fn repository_ids() {
        let e = "https://hub.example";
        let s = Source::parse("org/name", e, None, false).unwrap();
        assert_eq!(
            s.file_url("config.json"),
            "https://hub.example/org/name/resolve/main/config.json"
        );
        let s = Source::parse("org/name@v1.0", e, None, false).unwrap();
        assert_eq!(s.revision, "v1.0");
        let s = Source::parse("org/name", e, Some("refs/pr/3"), false).unwrap();
        assert_eq!(s.file_url("a"), "https://hub.example/org/name/resolve/refs%2Fpr%2F3/a");
        assert!(Source::parse("org/name@v1", e, Some("v1"), false).is_ok());
        for bad in [
            "org/name@a",
            "name",
            "org/na me",
            "../x",
            "org/name@",
            "-o/n",
            "org/name/extra",
        ] {
            let r = Source::parse(bad, e, Some("b"), false);
            assert!(r.is_err(), "{bad}");
            assert!(!r.unwrap_err().to_string().contains('\n'));
        }
        assert!(Source::parse("org/name", e, None, true).is_err());
        assert!(Source::parse("org/name", "ftp://x", None, false).is_err());
        // URLs pass through unchanged.
        let s = Source::parse("http://h/o/n", e, None, false).unwrap();
        assert_eq!(s.url, "http://h/o/n");
    }
}
