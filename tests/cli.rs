//! The command line refuses values it cannot honour with an error naming the flag, before any
//! work starts, and takes the smallest values it can.

use std::path::PathBuf;
use std::process::{Command, Output};

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-wrapper")
}

fn lily(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_lily"))
        .args(args)
        .output()
        .unwrap()
}

fn generate(extra: &[&str]) -> Output {
    let model = fixture();
    let mut args = vec!["generate", "--model", model.to_str().unwrap(), "--json"];
    args.extend(extra);
    lily(&args)
}

/// Fails, and its error output contains every one of `needles`.
fn assert_refused(out: &Output, needles: &[&str]) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "accepted: {stderr}");
    assert!(
        out.stdout.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    for needle in needles {
        assert!(stderr.contains(needle), "no {needle:?} in: {stderr}");
    }
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn zero_tokens_to_generate_is_refused() {
    assert_refused(
        &generate(&["--prompt-ids", "1,2", "--max-tokens", "0"]),
        &["--max-tokens"],
    );
}

#[test]
fn one_token_to_generate_gives_one() {
    let out = generate(&["--prompt-ids", "1,2", "--max-tokens", "1"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let result: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(result["ids"].as_array().map(Vec::len), Some(1), "{result}");
}

#[test]
fn a_negative_temperature_reaches_the_sampling_check() {
    // Written as a separate argument, it must not be taken for a flag.
    assert_refused(
        &generate(&["--prompt-ids", "1", "--temperature", "-1"]),
        &["temperature", "-1"],
    );
}

#[test]
fn a_context_too_short_for_one_token_is_refused_before_serving() {
    assert_refused(
        &lily(&["serve", "--context", "1", "--port", "0"]),
        &["--context"],
    );
}

#[test]
fn bad_token_ids_are_named() {
    assert_refused(
        &generate(&["--prompt-ids", "1,x"]),
        &["--prompt-ids", "\"x\""],
    );
    assert_refused(
        &generate(&["--prompt-ids", "99999999"]),
        &["99999999", "vocabulary"],
    );
}

/// A reader that stops early (`lily logits ... | head`) ends the command quietly, with the
/// status of a process ended by SIGPIPE, not a panic (`println!` panicked on the failed write).
/// Here the reader closes its end before any output comes.
#[test]
fn output_into_a_closed_pipe_stops_quietly() {
    use std::process::Stdio;
    let model = fixture();
    let ids: Vec<String> = (1..=200).map(|i| (i % 200).to_string()).collect();
    let mut child = Command::new(env!("CARGO_BIN_EXE_lily"))
        .args(["logits", "--model", model.to_str().unwrap()])
        .args(["--prompt-ids", &ids.join(",")])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(141), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

/// `lily perplexity` cuts the ids into windows, each scored from a fresh state without its first
/// token, and its mean negative log-likelihood is the one the windows' own logits (`lily
/// logits`) give.
#[test]
fn perplexity_is_the_mean_nll_of_each_windows_logits() {
    let model = fixture();
    let model = model.to_str().unwrap();
    let ids: Vec<u32> = (0..40).map(|i| (i * 37 % 200 + 1) as u32).collect();
    let list = |ids: &[u32]| ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
    let out = lily(&[
        "perplexity",
        "--model",
        model,
        "--ids",
        &list(&ids),
        "--window",
        "16",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let got: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(got["tokens"], 40);
    assert_eq!(got["windows"], 3);
    assert_eq!(got["scored"], 15 + 15 + 7);

    let mut total = 0f64;
    for window in ids.chunks(16) {
        let out = lily(&["logits", "--model", model, "--prompt-ids", &list(window)]);
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        for (row, &next) in v["logits"].as_array().unwrap().iter().zip(&window[1..]) {
            let row: Vec<f64> = row
                .as_array()
                .unwrap()
                .iter()
                .map(|l| l.as_f64().unwrap())
                .collect();
            let max = row.iter().copied().fold(f64::MIN, f64::max);
            let log_total = row.iter().map(|l| (l - max).exp()).sum::<f64>().ln();
            total -= row[next as usize] - max - log_total;
        }
    }
    let nll = got["nll"].as_f64().unwrap();
    assert!(
        (nll - total / 37.0).abs() < 1e-5,
        "{nll} vs {}",
        total / 37.0
    );
    assert!((got["perplexity"].as_f64().unwrap() - nll.exp()).abs() < 1e-9);

    let one = lily(&["perplexity", "--model", model, "--ids", "5"]);
    assert_refused(&one, &["at least two tokens"]);
}
