//! Diagnostics on stderr: the `tracing` subscriber of the binary.
//!
//! The libraries report what a user should hear about but that does not stop a command (an
//! HTTP retry, a download fetched again after a sha256 mismatch, a server that did not resume)
//! as `tracing` events. Without a subscriber they would be lost, so [`init`] installs one:
//! warnings and errors by default, `-v` adds info, `-vv` debug, `-vvv` trace; `RUST_LOG`, when
//! set, replaces that choice (`RUST_LOG=deltafin_pull=debug`, the `tracing-subscriber`
//! `EnvFilter` syntax). Each event is one line, `warning: …` as the commands' own warnings,
//! written while the active progress bar is hidden so the two never share a line.

use std::io::Write;
use std::sync::Mutex;

use tracing::{Event, Level, Subscriber};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields, MakeWriter};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::EnvFilter;

/// The progress bar drawn now, hidden while a diagnostic line is written.
static ACTIVE_BAR: Mutex<Option<indicatif::WeakProgressBar>> = Mutex::new(None);

/// Makes `bar` the one hidden while diagnostics are written (the latest bar shown wins).
pub(crate) fn set_active_bar(bar: &indicatif::ProgressBar) {
    if let Ok(mut b) = ACTIVE_BAR.lock() {
        *b = Some(bar.downgrade());
    }
}

/// The filter of `verbose` `-v` flags: `warn`, `info`, `debug`, then `trace`, for deltafin's own
/// crates; dependencies stay at `warn` so `-vvv` shows our events, not the HTTP stack's.
fn directive(verbose: u8) -> String {
    let level = match verbose {
        0 => return "warn".into(),
        1 => "info",
        2 => "debug",
        _ => "trace",
    };
    [
        "deltafin",
        "deltafin_pull",
        "deltafin_engine",
        "deltafin_format",
        "deltafin_server",
        "deltafin_tokenizer",
        "deltafin_kernels",
    ]
    .iter()
    .fold("warn".to_string(), |s, c| format!("{s},{c}={level}"))
}

/// Installs the stderr subscriber (see the module documentation). A malformed `RUST_LOG` is
/// reported on stderr and the `-v` level used instead.
pub(crate) fn init(verbose: u8) {
    let filter = match std::env::var("RUST_LOG") {
        Ok(v) if !v.trim().is_empty() => EnvFilter::try_new(&v).unwrap_or_else(|e| {
            eprintln!("warning: RUST_LOG={v:?} is not a valid filter ({e}); using the default");
            EnvFilter::new(directive(verbose))
        }),
        _ => EnvFilter::new(directive(verbose)),
    };
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(Stderr)
        .event_format(Line)
        .try_init();
}

/// One line per event: `warning: message key=value`.
struct Line;

impl<S, N> FormatEvent<S, N> for Line
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(&self, ctx: &FmtContext<'_, S, N>, mut w: Writer<'_>, event: &Event<'_>) -> std::fmt::Result {
        let level = match *event.metadata().level() {
            Level::ERROR => "error",
            Level::WARN => "warning",
            Level::INFO => "info",
            Level::DEBUG => "debug",
            Level::TRACE => "trace",
        };
        write!(w, "{level}: ")?;
        if *event.metadata().level() > Level::INFO {
            write!(w, "{}: ", event.metadata().target())?;
        }
        ctx.field_format().format_fields(w.by_ref(), event)?;
        writeln!(w)
    }
}

/// stderr, one whole line per write, with the active progress bar hidden meanwhile.
struct Stderr;

/// A line being formatted; written out on drop.
struct LineBuf(Vec<u8>);

impl Write for LineBuf {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for LineBuf {
    fn drop(&mut self) {
        let out = |b: &[u8]| {
            let _ = std::io::stderr().lock().write_all(b);
        };
        let bar = ACTIVE_BAR
            .lock()
            .ok()
            .and_then(|b| b.as_ref().and_then(|w| w.upgrade()))
            .filter(|b| !b.is_finished() && !b.is_hidden());
        match bar {
            Some(b) => b.suspend(|| out(&self.0)),
            None => out(&self.0),
        }
    }
}

impl<'a> MakeWriter<'a> for Stderr {
    type Writer = LineBuf;
    fn make_writer(&'a self) -> Self::Writer {
        LineBuf(Vec::new())
    }
}
