//! Every file of every fuzz target's corpus (`fuzz/corpus/TARGET/`), run through the
//! target's entry point in `sluice::fuzzing` on the stable toolchain: an input that
//! once crashed, or that the fuzzer kept for reaching new code, must keep passing.

use std::panic;
use std::path::Path;

#[test]
fn every_corpus_file_passes_its_target() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus");
    let mut failures = Vec::new();
    for (target, run) in sluice::fuzzing::TARGETS {
        let dir = root.join(target);
        let mut files: Vec<_> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .map(|e| e.expect("a directory entry").path())
            .collect();
        files.sort();
        assert!(!files.is_empty(), "{} is empty", dir.display());
        for file in files {
            let data = std::fs::read(&file).expect("a corpus file");
            if let Err(e) = panic::catch_unwind(|| run(&data)) {
                let why = e
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                failures.push(format!("{}: {why}", file.display()));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn every_target_has_a_corpus() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz");
    for (target, _) in sluice::fuzzing::TARGETS {
        assert!(
            root.join("fuzz_targets")
                .join(format!("{target}.rs"))
                .is_file(),
            "{target}"
        );
        assert!(root.join("corpus").join(target).is_dir(), "{target}");
    }
}
