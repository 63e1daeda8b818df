//! Kimi-style tiktoken vocabularies: `tiktoken.model` (`base64(bytes) rank` per line) plus
//! special tokens placed right after the ranks.
//!
//! Mirrors `tokenization_kimi.py` (moonshotai/Kimi-K2-Instruct): the special ids are
//! `num_base .. num_base + 256`, named from `tokenizer_config.json`'s `added_tokens_decoder`, the
//! unnamed ones `<|reserved_token_{id}|>`; special-token strings in the text are encoded as their
//! ids (`allowed_special="all"`).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};

use base64::Engine as _;
use tiktoken_rs::CoreBPE;

use crate::TokenizerError;

/// Kimi K2's split pattern, verbatim from `tokenization_kimi.py` `pat_str` (joined with `|`).
/// `&&[^\p{Han}]` is a class intersection: Han runs belong to the first alternative only.
pub const KIMI_K2_PAT_STR: &str = concat!(
    r"[\p{Han}]+",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|\p{N}{1,3}",
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"|\s*[\r\n]+",
    r"|\s+(?!\S)",
    r"|\s+",
);

/// `tokenization_kimi.py` `num_reserved_special_tokens`.
const NUM_RESERVED_SPECIAL_TOKENS: u32 = 256;

/// A loaded tiktoken vocabulary.
pub(crate) struct TiktokenBackend {
    bpe: CoreBPE,
    /// id -> bytes, for ranks and specials alike (specials: their UTF-8 content).
    pieces: Vec<Vec<u8>>,
    /// First special id == number of ranks.
    num_base: u32,
    specials: HashMap<String, u32>,
}

impl TiktokenBackend {
    /// Loads `path` (the `tiktoken.model`) with the named special tokens (`added_tokens_decoder`
    /// from `config_path`) and the split `pattern`.
    ///
    /// Errors: [`TokenizerError::TiktokenLine`] for a malformed line, bad base64, a bad or
    /// duplicate rank, or ranks that are not exactly `0..n`; [`TokenizerError::Field`] for an
    /// added token that collides with the ranks; [`TokenizerError::TiktokenBuild`] when the
    /// pattern does not compile.
    pub(crate) fn load(
        path: &Path,
        named_specials: &BTreeMap<u32, String>,
        config_path: &Path,
        pattern: &str,
    ) -> Result<Self, TokenizerError> {
        let data = deltafin_fs::read(path).map_err(|source| TokenizerError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let ranks = parse_ranks(path, &data)?;
        let num_base = u32::try_from(ranks.len()).map_err(|_| TokenizerError::TiktokenBuild {
            path: path.to_path_buf(),
            message: "more than 2^32 ranks".into(),
        })?;

        // Specials fill [num_base, num_base + 256), extended if a named id lies beyond.
        let mut end = num_base.saturating_add(NUM_RESERVED_SPECIAL_TOKENS);
        for (&id, content) in named_specials {
            if id < num_base {
                return Err(crate::config::field_error(
                    config_path,
                    &format!("added_tokens_decoder.{id}"),
                    format!(
                        "`{content}` has id {id}, inside the {num_base} BPE ranks of {}",
                        path.display()
                    ),
                ));
            }
            end = end.max(id.saturating_add(1));
        }
        let mut pieces: Vec<Vec<u8>> = vec![Vec::new(); end as usize];
        for (bytes, rank) in &ranks {
            pieces[*rank as usize] = bytes.clone();
        }
        let mut specials = HashMap::with_capacity((end - num_base) as usize);
        for id in num_base..end {
            let name = named_specials
                .get(&id)
                .cloned()
                .unwrap_or_else(|| format!("<|reserved_token_{id}|>"));
            if let Some(prev) = specials.insert(name.clone(), id) {
                return Err(crate::config::field_error(
                    config_path,
                    "added_tokens_decoder",
                    format!("`{name}` is used by both id {prev} and id {id}"),
                ));
            }
            pieces[id as usize] = name.into_bytes();
        }

        // CoreBPE::new wants its own (FxHash) map type; let inference pick it.
        let mut encoder = HashMap::default();
        encoder.extend(ranks);
        let mut special_encoder = HashMap::default();
        special_encoder.extend(specials.iter().map(|(k, v)| (k.clone(), *v)));
        let bpe = CoreBPE::new(encoder, special_encoder, pattern).map_err(|e| TokenizerError::TiktokenBuild {
            path: path.to_path_buf(),
            message: format!("split pattern or special tokens do not compile: {e}"),
        })?;
        Ok(Self {
            bpe,
            pieces,
            num_base,
            specials,
        })
    }

    /// Number of ids: ranks plus the special range.
    pub(crate) fn vocab_size(&self) -> usize {
        self.pieces.len()
    }

    /// Encodes with every special token allowed (`allowed_special="all"`).
    pub(crate) fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let allowed: HashSet<&str> = self.specials.keys().map(String::as_str).collect();
        self.bpe
            .encode(text, &allowed)
            .map(|(ids, _)| ids)
            .map_err(|e| TokenizerError::Encode { message: e.message })
    }

    /// The bytes of one id, or `None` for a special id when skipping specials.
    ///
    /// Errors: [`TokenizerError::UnknownTokenId`] outside the vocabulary.
    pub(crate) fn piece(&self, id: u32, skip_special_tokens: bool) -> Result<Option<&[u8]>, TokenizerError> {
        let piece = self.pieces.get(id as usize).ok_or(TokenizerError::UnknownTokenId {
            id,
            vocab_size: self.pieces.len(),
        })?;
        if skip_special_tokens && id >= self.num_base {
            return Ok(None);
        }
        Ok(Some(piece))
    }

    /// Concatenates the bytes of `ids` and decodes them as UTF-8, replacing invalid sequences with
    /// U+FFFD (Python's `errors="replace"`).
    pub(crate) fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, TokenizerError> {
        let mut bytes = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            if let Some(p) = self.piece(id, skip_special_tokens)? {
                bytes.extend_from_slice(p);
            }
        }
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    /// Special tokens by content, then ordinary tokens whose bytes are the string's UTF-8.
    pub(crate) fn token_to_id(&self, token: &str) -> Option<u32> {
        if let Some(&id) = self.specials.get(token) {
            return Some(id);
        }
        self.pieces[..self.num_base as usize]
            .iter()
            .position(|p| p.as_slice() == token.as_bytes())
            .and_then(|i| u32::try_from(i).ok())
    }
}

/// Parses `base64(bytes) rank` lines (blank lines skipped, like `load_tiktoken_bpe`), checking
/// that tokens and ranks are unique and that the ranks are exactly `0..n`.
fn parse_ranks(path: &Path, data: &[u8]) -> Result<Vec<(Vec<u8>, u32)>, TokenizerError> {
    let line_err = |line: usize, message: String| TokenizerError::TiktokenLine {
        path: PathBuf::from(path),
        line,
        message,
    };
    let mut out = Vec::new();
    let mut seen_tokens: HashMap<Vec<u8>, usize> = HashMap::new();
    let mut seen_ranks: HashMap<u32, usize> = HashMap::new();
    for (i, raw) in data.split(|&b| b == b'\n').enumerate() {
        let line_no = i + 1;
        let mut fields = raw.split(|b| b.is_ascii_whitespace()).filter(|f| !f.is_empty());
        let (Some(token_b64), Some(rank)) = (fields.next(), fields.next()) else {
            if raw.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            return Err(line_err(line_no, "expected `base64(bytes) rank`".into()));
        };
        if fields.next().is_some() {
            return Err(line_err(
                line_no,
                "expected exactly two fields: `base64(bytes) rank`".into(),
            ));
        }
        let token = base64::engine::general_purpose::STANDARD
            .decode(token_b64)
            .map_err(|e| line_err(line_no, format!("invalid base64 token: {e}")))?;
        let rank: u32 = std::str::from_utf8(rank)
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| line_err(line_no, format!("invalid rank `{}`", String::from_utf8_lossy(rank))))?;
        if let Some(prev) = seen_tokens.insert(token.clone(), line_no) {
            return Err(line_err(line_no, format!("duplicate token (first on line {prev})")));
        }
        if let Some(prev) = seen_ranks.insert(rank, line_no) {
            return Err(line_err(
                line_no,
                format!("duplicate rank {rank} (first on line {prev})"),
            ));
        }
        out.push((token, rank));
    }
    let n = out.len();
    if let Some((i, (_, rank))) = out.iter().enumerate().find(|(_, (_, r))| *r as usize >= n) {
        let line_no = seen_ranks.get(rank).copied().unwrap_or(i + 1);
        return Err(line_err(
            line_no,
            format!(
                "rank {rank} is not below the number of ranks ({n}); ranks must be 0..{n} so special ids can follow"
            ),
        ));
    }
    Ok(out)
}
