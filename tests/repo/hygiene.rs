//! The harness leaves no process behind: the children a test starts (redis-server,
//! `sluice run`) die with it, whether it ends by a panic or is killed outright (as by
//! Ctrl-C or a CI timeout). Each case runs a helper test of this binary in a child
//! process, reads the pids it started, ends it, and checks that they are gone.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::common;
use crate::common::redis::{RedisServer, SluiceProcess};

const ROUTE: &str = "routes:\n  - {name: r, match: {path_prefix: /}, respond: {body: ok}}\n";

/// Helper, run only by `orphans_after`: starts a redis-server and a `sluice run`,
/// prints their pids, then panics or waits to be killed.
#[tokio::test]
#[ignore = "started by the other tests of this file"]
async fn helper_starts_children() {
    let redis = RedisServer::start();
    let sluice = SluiceProcess::start(&[], &[], ROUTE).await;
    let redis_pid = pid_on_port(redis.port);
    println!("PIDS {redis_pid} {}", sluice.child.id());
    if std::env::var("HYGIENE_PANIC").is_ok() {
        panic!("a test failing with children running");
    }
    tokio::time::sleep(Duration::from_secs(60)).await;
}

/// The pid of the process listening on 127.0.0.1:`port` (from /proc/net/tcp and
/// the owners of the socket inodes).
fn pid_on_port(port: u16) -> u32 {
    let tcp = std::fs::read_to_string("/proc/net/tcp").expect("/proc/net/tcp");
    let local = format!("0100007F:{port:04X}");
    let inode = tcp
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .find(|f| f.len() > 9 && f[1] == local && f[3] == "0A")
        .map(|f| f[9].to_string())
        .expect("a listener on the port");
    let target = format!("socket:[{inode}]");
    for proc in std::fs::read_dir("/proc").expect("/proc").flatten() {
        let Ok(pid) = proc.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(fds) = std::fs::read_dir(proc.path().join("fd")) else {
            continue;
        };
        for fd in fds.flatten() {
            if std::fs::read_link(fd.path()).is_ok_and(|l| l.to_string_lossy() == target) {
                return pid;
            }
        }
    }
    panic!("no process holds {target}");
}

fn alive(pid: u32) -> bool {
    // A zombie is dead (only not yet reaped by its parent).
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            !s.rsplit(')')
                .next()
                .unwrap_or("")
                .trim_start()
                .starts_with('Z')
        })
        .unwrap_or(false)
}

/// Runs the helper (panicking or not), ends it as `end` says once it has printed
/// its pids, and returns the pids still alive 5 s later.
fn orphans_after(panic: bool, kill: bool) -> Vec<u32> {
    let mut cmd = Command::new(std::env::current_exe().expect("test binary"));
    cmd.arg(common::test_name(module_path!(), "helper_starts_children"))
        .args(["--exact", "--ignored", "--nocapture"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    if panic {
        cmd.env("HYGIENE_PANIC", "1");
    }
    let mut helper = common::spawn_grouped(&mut cmd).expect("run the helper");
    let out = BufReader::new(helper.stdout.take().expect("stdout"));
    let pids: Vec<u32> = out
        .lines()
        .map_while(Result::ok)
        .find_map(|l| {
            l.strip_prefix("PIDS ")
                .map(|p| p.split(' ').map(|n| n.parse().expect("pid")).collect())
        })
        .expect("the helper prints its children's pids");
    assert_eq!(pids.len(), 2);
    assert!(pids.iter().all(|p| alive(*p)), "{pids:?}");
    if kill {
        // SIGKILL to the helper alone: no unwinding, no destructor runs.
        helper.signal(libc::SIGKILL);
    }
    let status = helper.wait().expect("wait");
    assert!(!status.success(), "the helper ended well: {status}");
    let t0 = Instant::now();
    while pids.iter().any(|p| alive(*p)) && t0.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(20));
    }
    pids.into_iter().filter(|p| alive(*p)).collect()
}

#[test]
fn a_panicking_test_leaves_no_process() {
    assert_eq!(orphans_after(true, false), Vec::<u32>::new());
}

#[test]
fn a_killed_test_leaves_no_process() {
    let left = orphans_after(false, true);
    // Clean up after a failure, so that the failure itself leaves nothing.
    for pid in &left {
        // SAFETY: kill(2); no memory involved.
        unsafe {
            libc::kill(*pid as libc::pid_t, libc::SIGKILL);
        }
    }
    assert_eq!(left, Vec::<u32>::new(), "still running after the test died");
}
