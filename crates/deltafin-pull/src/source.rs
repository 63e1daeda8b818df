//! Where a source's files live.

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

    /// URL of `file` in the repository.
    pub fn file_url(&self, file: &str) -> String {
        if self.flat {
            format!("{}/{file}", self.url)
        } else {
            format!("{}/resolve/{}/{file}", self.url, self.revision)
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
}
