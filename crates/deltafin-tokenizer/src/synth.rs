//! Synthetic byte-level BPE tokenizers for demo and benchmark models.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::processors::sequence::Sequence as ProcessorSequence;
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::processors::PostProcessorWrapper;
use tokenizers::{AddedToken, OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};

use crate::TokenizerError;

/// GPT-2's reversible byte -> printable-char table (`bytes_to_unicode` in openai/gpt-2
/// `encoder.py`): printable Latin-1 bytes map to themselves, the other 68 bytes to U+0100.. in
/// byte order.
pub(crate) fn byte_to_char() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut next = 256u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        let code = if printable {
            u32::from(b)
        } else {
            let c = next;
            next += 1;
            c
        };
        table[b as usize] = char::from_u32(code).unwrap_or('\0');
    }
    table
}

/// Writes `tokenizer.json` and `tokenizer_config.json` into `dir`: a real byte-level BPE whose
/// ids `0..256` are the 256 bytes (in byte order, GPT-2 byte-to-unicode spelling), followed by up
/// to `n_merges` merges learned from `corpus`, followed by `specials` (plus `bos`/`eos` if not
/// listed) as added special tokens. The pre-tokenizer and decoder are `ByteLevel` (GPT-2 split
/// regex, no prefix space); the post-processor prepends `bos`. `tokenizer_config.json` carries
/// `bos_token`, `eos_token`, `add_bos_token: true` and `chat_template`.
///
/// Merge learning is deterministic: each step merges the most frequent adjacent pair within
/// pre-tokenized words, ties broken by the smaller (left id, right id); it stops early when no
/// pair occurs at least twice. Returns the vocabulary size including specials.
///
/// Errors: [`TokenizerError::Synth`] when `bos`/`eos` are empty, the directory or files cannot
/// be written, or the `tokenizers` crate rejects the construction.
pub fn write_byte_level_tokenizer(
    dir: &Path,
    corpus: &str,
    n_merges: usize,
    specials: &[&str],
    bos: &str,
    eos: &str,
    chat_template: &str,
) -> Result<usize, TokenizerError> {
    let json_path = dir.join("tokenizer.json");
    let synth_err = |path: &Path, message: String| TokenizerError::Synth {
        path: path.to_path_buf(),
        message,
    };
    if bos.is_empty() || eos.is_empty() {
        return Err(synth_err(&json_path, "bos and eos must be non-empty".into()));
    }
    std::fs::create_dir_all(dir).map_err(|e| TokenizerError::Io {
        path: dir.to_path_buf(),
        source: e,
    })?;

    let chars = byte_to_char();
    let mut tokens: Vec<String> = chars.iter().map(|c| c.to_string()).collect();
    let merges = learn_merges(corpus, n_merges, &mut tokens).map_err(|m| synth_err(&json_path, m))?;
    let vocab: Vocab = tokens.iter().enumerate().map(|(i, t)| (t.clone(), i as u32)).collect();
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .build()
        .map_err(|e| synth_err(&json_path, format!("BPE: {e}")))?;

    let mut tok = tokenizers::Tokenizer::new(bpe);
    tok.with_pre_tokenizer(Some(ByteLevel::default().add_prefix_space(false)));
    tok.with_decoder(Some(ByteLevelDecoder::default()));
    let mut all_specials: Vec<&str> = Vec::new();
    for s in specials.iter().copied().chain([bos, eos]) {
        if !all_specials.contains(&s) {
            all_specials.push(s);
        }
    }
    let added: Vec<AddedToken> = all_specials.iter().map(|s| AddedToken::from(*s, true)).collect();
    tok.add_special_tokens(added)
        .map_err(|e| synth_err(&json_path, format!("adding special tokens: {e}")))?;
    let bos_id = tok
        .token_to_id(bos)
        .ok_or_else(|| synth_err(&json_path, format!("bos `{bos}` missing after adding specials")))?;
    let template = TemplateProcessing::builder()
        .try_single(format!("{bos} $A"))
        .and_then(|b| b.try_pair(format!("{bos} $A {bos} $B")))
        .map_err(|e| synth_err(&json_path, format!("post-processor template: {e}")))?
        .special_tokens(vec![(bos, bos_id)])
        .build()
        .map_err(|e| synth_err(&json_path, format!("post-processor: {e}")))?;
    let processor = ProcessorSequence::new(vec![
        PostProcessorWrapper::ByteLevel(ByteLevel::default().trim_offsets(false)),
        PostProcessorWrapper::Template(template),
    ]);
    tok.with_post_processor(Some(processor));
    tok.save(&json_path, false)
        .map_err(|e| synth_err(&json_path, e.to_string()))?;

    let config_path = dir.join("tokenizer_config.json");
    let config = serde_json::json!({
        "add_bos_token": true,
        "add_eos_token": false,
        "bos_token": bos,
        "eos_token": eos,
        "clean_up_tokenization_spaces": false,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": chat_template,
    });
    let text = serde_json::to_string_pretty(&config).map_err(|e| synth_err(&config_path, e.to_string()))?;
    std::fs::write(&config_path, text + "\n").map_err(|source| TokenizerError::Io {
        path: config_path.clone(),
        source,
    })?;
    Ok(tok.get_vocab_size(true))
}

/// Learns up to `n_merges` BPE merges over the byte-level words of `corpus`, appending new
/// tokens to `tokens` (which starts as the 256 byte tokens, index == id).
fn learn_merges(corpus: &str, n_merges: usize, tokens: &mut Vec<String>) -> Result<Vec<(String, String)>, String> {
    // Words as the ByteLevel pre-tokenizer splits them (GPT-2 regex + byte-to-unicode).
    let mut pretok = PreTokenizedString::from(corpus);
    ByteLevel::default()
        .add_prefix_space(false)
        .pre_tokenize(&mut pretok)
        .map_err(|e| format!("pre-tokenizing corpus: {e}"))?;
    let mut word_counts: BTreeMap<String, u64> = BTreeMap::new();
    for (word, _, _) in pretok.get_splits(OffsetReferential::Original, OffsetType::Byte) {
        *word_counts.entry(word.to_string()).or_default() += 1;
    }
    let id_of: HashMap<char, u32> = tokens
        .iter()
        .enumerate()
        .filter_map(|(i, t)| t.chars().next().map(|c| (c, i as u32)))
        .collect();
    let mut words: Vec<(Vec<u32>, u64)> = Vec::with_capacity(word_counts.len());
    for (word, count) in word_counts {
        let ids = word
            .chars()
            .map(|c| {
                id_of
                    .get(&c)
                    .copied()
                    .ok_or(format!("char {c:?} outside the byte alphabet"))
            })
            .collect::<Result<Vec<u32>, String>>()?;
        words.push((ids, count));
    }

    let mut token_ids: HashMap<String, u32> = tokens.iter().enumerate().map(|(i, t)| (t.clone(), i as u32)).collect();
    let mut merges = Vec::new();
    for _ in 0..n_merges {
        let mut pair_counts: HashMap<(u32, u32), u64> = HashMap::new();
        for (ids, count) in &words {
            for w in ids.windows(2) {
                *pair_counts.entry((w[0], w[1])).or_default() += count;
            }
        }
        // Most frequent; ties -> smallest pair, so the result is independent of hash order.
        let Some((&(a, b), &count)) = pair_counts
            .iter()
            .max_by(|x, y| x.1.cmp(y.1).then_with(|| y.0.cmp(x.0)))
        else {
            break;
        };
        if count < 2 {
            break;
        }
        let merged = format!("{}{}", tokens[a as usize], tokens[b as usize]);
        let new_id = match token_ids.get(&merged) {
            Some(&id) => id,
            None => {
                let id = tokens.len() as u32;
                tokens.push(merged.clone());
                token_ids.insert(merged, id);
                id
            }
        };
        merges.push((tokens[a as usize].clone(), tokens[b as usize].clone()));
        for (ids, _) in &mut words {
            let mut i = 0;
            let mut out = Vec::with_capacity(ids.len());
            while i < ids.len() {
                if i + 1 < ids.len() && ids[i] == a && ids[i + 1] == b {
                    out.push(new_id);
                    i += 2;
                } else {
                    out.push(ids[i]);
                    i += 1;
                }
            }
            *ids = out;
        }
    }
    Ok(merges)
}
