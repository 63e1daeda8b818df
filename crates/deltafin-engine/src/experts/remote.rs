//! Records of a streaming install that are not local yet: fetched on demand through a
//! [`RecordSource`], made durable, journaled, then read like any other record.
//!
//! A streaming install's `experts.pack` is a sparse file with the offsets of a full convert; the
//! presence journal (`deltafin_format::presence`) says which records hold data and carries their
//! checksums. Before a demand fetch queues reads, [`Streaming::ensure`] makes the requested records
//! present: with a source, it fetches the absent ones (at most
//! [`RecordSource::max_concurrent`] at once), writes and fsyncs their bytes, then appends their
//! journal entries; without one (network not allowed) it fails naming the expert and the command
//! that fetches it. Speculative reads never fetch: they skip absent records.

use std::fmt;
use std::fs::{File, OpenOptions};
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, PoisonError};

use deltafin_format::model_dir::ExpertRecord;
use deltafin_format::presence::{commit_records, Journal};
use deltafin_format::ModelDir;

use super::RecordInfo;
use crate::EngineError;

/// Where a streaming install's missing expert records come from (e.g. HTTP range reads of the
/// source checkpoint, converted by the same code as a full convert).
pub trait RecordSource: Send + Sync {
    /// The record of routed expert `expert` in MoE layer `layer`: exactly the record's `length`
    /// bytes as a full convert writes them (no alignment padding).
    ///
    /// Errors: a one-line reason (network, server, source changed...).
    fn fetch_record(&self, layer: usize, expert: usize) -> Result<Vec<u8>, String>;

    /// The source for messages (a URL).
    fn describe(&self) -> String;

    /// Records fetched at once at most.
    fn max_concurrent(&self) -> usize {
        4
    }
}

/// A shared [`RecordSource`] as a store option (compared by identity).
#[derive(Clone)]
pub struct Remote(pub Arc<dyn RecordSource>);

impl fmt::Debug for Remote {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Remote({})", self.0.describe())
    }
}

impl PartialEq for Remote {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

/// The streaming side of an [`super::ExpertStore`]: present bits live in the store's record
/// table; this holds the source and the writer.
pub(crate) struct Streaming {
    dir: PathBuf,
    /// Manifest records by `[layer][expert]` (empty for dense layers).
    records: Vec<Vec<ExpertRecord>>,
    source: Option<Arc<dyn RecordSource>>,
    /// Pack opened for writing and the journal, opened at the first fetch; the lock also makes
    /// one fetch batch run at a time.
    writer: Mutex<Option<(File, Journal)>>,
}

impl Streaming {
    pub(crate) fn new(dir: &ModelDir, source: Option<Arc<dyn RecordSource>>) -> Self {
        let cfg = &dir.manifest.config;
        let records = (0..cfg.num_hidden_layers())
            .map(|l| {
                if cfg.is_moe_layer(l) {
                    (0..cfg.n_routed_experts()).map(|e| dir.record(l, e).clone()).collect()
                } else {
                    Vec::new()
                }
            })
            .collect();
        Streaming {
            dir: dir.path.clone(),
            records,
            source,
            writer: Mutex::new(None),
        }
    }

    /// Makes the records of `experts` in `layer` present (see the module docs).
    ///
    /// Errors: [`EngineError::ExpertNotLocal`] without a source; [`EngineError::ExpertFetch`]
    /// when fetching or writing fails (records already written stay valid).
    pub(crate) fn ensure(&self, table: &[Vec<RecordInfo>], layer: usize, experts: &[usize]) -> Result<(), EngineError> {
        let absent = |table: &[Vec<RecordInfo>]| -> Vec<usize> {
            let mut v: Vec<usize> = experts
                .iter()
                .copied()
                .filter(|&e| !table[layer][e].present.load(Ordering::Acquire))
                .collect();
            v.sort_unstable();
            v.dedup();
            v
        };
        if absent(table).is_empty() {
            return Ok(());
        }
        let Some(source) = &self.source else {
            return Err(EngineError::ExpertNotLocal {
                dir: self.dir.clone(),
                layer,
                expert: absent(table)[0],
            });
        };
        let mut writer = self.writer.lock().unwrap_or_else(PoisonError::into_inner);
        // Another caller may have fetched them while we waited for the lock.
        let absent = absent(table);
        let fail = |expert: usize, message: String| EngineError::ExpertFetch {
            dir: self.dir.clone(),
            layer,
            expert,
            url: source.describe(),
            message,
        };
        if writer.is_none() {
            let pack_path = self.dir.join("experts.pack");
            let pack = deltafin_fs::open_regular_with(OpenOptions::new().write(true), 0, &pack_path)
                .map_err(|e| fail(absent[0], format!("{}: {e}", pack_path.display())))?;
            let journal = Journal::open(&self.dir).map_err(|e| fail(absent[0], e.to_string()))?;
            *writer = Some((pack, journal));
        }
        let Some((pack, journal)) = writer.as_ref() else {
            return Ok(());
        };
        for batch in absent.chunks(source.max_concurrent().max(1)) {
            let fetched: Vec<(usize, Result<Vec<u8>, String>)> = std::thread::scope(|s| {
                let handles: Vec<_> = batch
                    .iter()
                    .map(|&e| (e, s.spawn(move || source.fetch_record(layer, e))))
                    .collect();
                handles
                    .into_iter()
                    .map(|(e, h)| (e, h.join().unwrap_or_else(|_| Err("fetch thread panicked".into()))))
                    .collect()
            });
            let mut good = Vec::new();
            let mut first_err = None;
            for (e, r) in fetched {
                match r {
                    Ok(bytes) => good.push((e, bytes)),
                    Err(m) => {
                        first_err.get_or_insert((e, m));
                    }
                }
            }
            let items: Vec<(&ExpertRecord, &[u8])> = good
                .iter()
                .map(|(e, b)| (&self.records[layer][*e], b.as_slice()))
                .collect();
            if !items.is_empty() {
                let pack_path = self.dir.join("experts.pack");
                let hashes =
                    commit_records(pack, &pack_path, journal, &items).map_err(|e| fail(good[0].0, e.to_string()))?;
                for ((e, _), h) in good.iter().zip(hashes) {
                    let info = &table[layer][*e];
                    info.xxh3.store(h, Ordering::Release);
                    info.present.store(true, Ordering::Release);
                }
            }
            if let Some((e, m)) = first_err {
                return Err(fail(e, m));
            }
        }
        Ok(())
    }
}
