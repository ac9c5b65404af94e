//! The workload `scripts/build-pgo` trains the production build on
//! (examples/pgo_train.rs), run briefly against this build of sluice: it must
//! drive every phase on both stores and get exactly the answers each phase
//! should, or the profile would be of something else (errors, refusals).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;

use crate::common::run_grouped;

fn trainer() -> PathBuf {
    // target/<profile>/deps/<this test> -> target/<profile>/examples/pgo_train
    let exe = std::env::current_exe().expect("test path");
    let dir = exe.parent().and_then(|d| d.parent()).expect("target dir");
    let path = dir.join("examples").join("pgo_train");
    assert!(
        path.exists(),
        "{} is missing: `cargo test` builds examples (alone, this test needs `cargo build --example pgo_train` first, or it runs a stale one)",
        path.display()
    );
    path
}

#[test]
fn the_training_workload_gets_the_answers_each_phase_should_on_both_stores() {
    let out = run_grouped(
        Command::new(trainer())
            .arg(env!("CARGO_BIN_EXE_sluice"))
            .args(["--seconds", "0.2"]),
    )
    .expect("run pgo_train");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "pgo_train failed: {}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );

    // "<store> <phase>: 200=12 429=3" -> {(store, phase): {200: 12, 429: 3}}
    let mut seen: BTreeMap<(String, String), BTreeMap<u16, u64>> = BTreeMap::new();
    for line in stdout.lines() {
        let (what, counts) = line.split_once(": ").expect("a phase line");
        let (store, phase) = what.split_once(' ').expect("store and phase");
        let counts = counts
            .split(' ')
            .map(|c| {
                let (s, n) = c.split_once('=').expect("status=count");
                (s.parse().expect("status"), n.parse().expect("count"))
            })
            .collect();
        seen.insert((store.into(), phase.into()), counts);
    }
    let phases = [
        ("hot", 200),
        ("rotating", 200),
        ("algorithms", 200),
        ("refused", 0),
        ("denied", 403),
        ("bodies", 200),
        ("large", 200),
        ("respond", 200),
        ("close", 200),
        ("h2c", 200),
        ("admin", 200),
    ];
    assert_eq!(
        seen.len(),
        2 * phases.len(),
        "every phase on both stores (redis-server must be installed: tests/run.sh installs it)\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for store in ["memory", "redis"] {
        for (phase, status) in phases {
            let counts = &seen[&(store.to_string(), phase.to_string())];
            if phase == "refused" {
                // Five a window on one key: exactly five pass, the rest are refused.
                assert_eq!(
                    counts.keys().copied().collect::<Vec<_>>(),
                    [200, 429],
                    "{store} {phase}"
                );
                assert_eq!(counts[&200], 5, "{store} {phase}");
            } else {
                assert_eq!(
                    counts.keys().copied().collect::<Vec<_>>(),
                    [status],
                    "{store} {phase}"
                );
                assert!(counts[&status] > 0, "{store} {phase}");
            }
        }
    }
}
