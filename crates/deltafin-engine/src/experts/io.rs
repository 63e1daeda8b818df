//! Reading expert records from `experts.pack`: O_DIRECT or buffered `pread`.
//!
//! Records start at 4096-aligned offsets and are padded with zeros to a 4096-aligned stride, so a
//! record is read as one span of `round_up(length, 4096)` bytes into a page-aligned buffer, which
//! satisfies O_DIRECT on devices with logical blocks of up to 4 KiB. The last record of a pack
//! may end at EOF before its rounded length: the read then comes back short, which is fine as
//! long as it covers the record's `length` data bytes.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use deltafin_format::AlignedBuf;

use super::IoMode;
use crate::EngineError;

/// Alignment of O_DIRECT offsets, lengths and buffers, bytes.
pub(crate) const DIRECT_ALIGN: usize = 4096;

/// `n` rounded up to a multiple of [`DIRECT_ALIGN`].
pub(crate) fn round_up(n: u64) -> u64 {
    n.div_ceil(DIRECT_ALIGN as u64) * DIRECT_ALIGN as u64
}

/// Why a record read failed, in a form every waiter of a shared read can receive.
#[derive(Debug, Clone)]
pub(crate) enum ReadFailure {
    Io(io::ErrorKind, String),
    Checksum { expected: u64, found: u64 },
}

impl ReadFailure {
    pub(crate) fn into_error(self, path: &Path, layer: usize, expert: usize) -> EngineError {
        match self {
            ReadFailure::Io(kind, msg) => EngineError::ExpertIo {
                path: path.to_path_buf(),
                layer,
                expert,
                error: io::Error::new(kind, msg),
            },
            ReadFailure::Checksum { expected, found } => EngineError::ExpertChecksum {
                path: path.to_path_buf(),
                layer,
                expert,
                expected: format!("{expected:016x}"),
                found: format!("{found:016x}"),
            },
        }
    }
}

impl From<io::Error> for ReadFailure {
    fn from(e: io::Error) -> Self {
        ReadFailure::Io(e.kind(), e.to_string())
    }
}

/// `experts.pack`, opened for the chosen I/O mode.
pub(crate) struct PackFile {
    file: File,
    pub(crate) path: PathBuf,
    mode: IoMode,
}

impl PackFile {
    /// Opens the pack. `Direct` opens with O_DIRECT and probes one aligned read, so a file system
    /// that accepts the flag at open but refuses the reads (tmpfs refuses at open, some FUSE and
    /// network file systems at read) is reported here, never discovered mid-generation.
    ///
    /// Errors: the file cannot be opened; O_DIRECT refused (the message suggests `--io buffered`;
    /// there is no silent fallback).
    pub(crate) fn open(path: &Path, mode: IoMode) -> Result<Self, EngineError> {
        let io_err = |e: io::Error| {
            EngineError::Format(deltafin_format::FormatError::Io {
                path: path.to_path_buf(),
                error: e,
            })
        };
        let refused = |e: io::Error| {
            EngineError::Invalid(format!(
                "{}: the file system refuses O_DIRECT ({e}); run with `--io buffered`",
                path.display()
            ))
        };
        let file = match mode {
            IoMode::Direct => {
                let f = deltafin_fs::open_regular_with(OpenOptions::new().read(true), libc::O_DIRECT, path).map_err(
                    |e| {
                        if e.raw_os_error() == Some(libc::EINVAL) {
                            refused(e)
                        } else {
                            io_err(e)
                        }
                    },
                )?;
                let mut probe = AlignedBuf::zeroed(DIRECT_ALIGN, DIRECT_ALIGN);
                if let Err(e) = f.read_at(probe.as_mut_slice(), 0) {
                    return Err(if e.raw_os_error() == Some(libc::EINVAL) {
                        refused(e)
                    } else {
                        io_err(e)
                    });
                }
                f
            }
            IoMode::Buffered => {
                let f = deltafin_fs::open_regular(path).map_err(io_err)?;
                // Records are read whole and at random: kernel readahead past a record only
                // evicts page cache that may hold other records.
                // SAFETY: plain syscall on a valid, open descriptor.
                let rc = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_RANDOM) };
                if rc != 0 {
                    tracing::debug!("posix_fadvise(RANDOM) on {} failed: {rc}", path.display());
                }
                f
            }
        };
        Ok(PackFile {
            file,
            path: path.to_path_buf(),
            mode,
        })
    }

    /// Reads into all of `buf` from `offset`, stopping early only at end of file; returns the
    /// bytes read. In direct mode `offset`, `buf.len()` and the buffer address must be multiples
    /// of [`DIRECT_ALIGN`].
    pub(crate) fn read_span(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        let mut done = 0;
        while done < buf.len() {
            match self.file.read_at(&mut buf[done..], offset + done as u64) {
                Ok(0) => break,
                Ok(n) => {
                    done += n;
                    // An O_DIRECT read comes back short of a block multiple only at EOF; the next
                    // offset would be unaligned and refused.
                    if self.mode == IoMode::Direct && n % DIRECT_ALIGN != 0 {
                        break;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(done)
    }
}
