//! The model directory argument, given the same way to every command.

use std::path::{Path, PathBuf};

/// A model directory, given positionally or with `--model` (either, not both), the same way
/// for every command.
#[derive(clap::Args, Clone, Debug)]
#[group(required = true, multiple = false)]
pub(crate) struct ModelPath {
    /// Model directory (positionally, or with --model).
    #[arg(value_name = "MODEL_DIR")]
    model_dir: Option<PathBuf>,
    /// Model directory (the same as the positional MODEL_DIR).
    #[arg(long = "model", value_name = "MODEL_DIR")]
    model: Option<PathBuf>,
}

impl ModelPath {
    /// The directory, however it was given (clap requires one of the two).
    pub(crate) fn path(&self) -> &Path {
        self.model_dir
            .as_deref()
            .or(self.model.as_deref())
            .unwrap_or(Path::new(""))
    }
}

impl std::ops::Deref for ModelPath {
    type Target = Path;
    fn deref(&self) -> &Path {
        self.path()
    }
}

impl AsRef<Path> for ModelPath {
    fn as_ref(&self) -> &Path {
        self.path()
    }
}
