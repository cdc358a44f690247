//! Child processes for multi-process tests: the test binary re-runs itself
//! with `--exact <test>` and `DXNET_CHILD=1`, so a `child_*` test (which does
//! nothing unless `DXNET_CHILD` is set) becomes one node process. The parent
//! reads the child's stdout line by line (to wait for markers), can write
//! commands to its stdin, send it signals, and run it inside a network
//! namespace.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use dxnet::Error;

/// A child node process.
pub struct ChildProc {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Arc<Mutex<Vec<String>>>,
    reader: Option<JoinHandle<()>>,
    name: String,
}

/// True in a child process (the `child_*` tests return at once otherwise).
pub fn is_child() -> bool {
    std::env::var("DXNET_CHILD").is_ok()
}

/// An environment variable the parent must have set.
pub fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} not set"))
}

/// Parsed environment variable.
pub fn env_parse<T: std::str::FromStr>(name: &str) -> T
where
    T::Err: std::fmt::Debug,
{
    env(name).parse().unwrap()
}

impl ChildProc {
    /// Runs test `test` of this binary as a child process with `vars`.
    pub fn spawn(test: &str, vars: &[(&str, String)]) -> Self {
        Self::spawn_in(None, test, vars)
    }

    /// Like [`ChildProc::spawn`], inside network namespace `netns` (via
    /// `ip netns exec`) if given.
    pub fn spawn_in(netns: Option<&str>, test: &str, vars: &[(&str, String)]) -> Self {
        let exe = std::env::current_exe().unwrap();
        let mut cmd = match netns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns]).arg(&exe);
                c
            }
            None => Command::new(&exe),
        };
        cmd.args(["--exact", test, "--nocapture", "--test-threads=1"])
            .env("DXNET_CHILD", "1")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        for (k, v) in vars {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spawn child process");
        let stdout = child.stdout.take().unwrap();
        let stdin = child.stdin.take();
        let lines = Arc::new(Mutex::new(Vec::new()));
        let l = lines.clone();
        let name = format!(
            "{test}[{}]",
            vars.iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect::<Vec<_>>()
                .join(",")
        );
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                l.lock().unwrap().push(line);
            }
        });
        Self {
            child,
            stdin,
            lines,
            reader: Some(reader),
            name,
        }
    }

    /// The child's process id.
    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// Everything the child printed so far.
    pub fn output(&self) -> String {
        self.lines.lock().unwrap().join("\n")
    }

    /// The first line printed so far that starts with `prefix` (after the
    /// test harness's "test name ... " that may precede the first line),
    /// from `prefix` on.
    pub fn find_line(&self, prefix: &str) -> Option<String> {
        self.find_line_since(0, prefix)
    }

    fn find_line_since(&self, mark: usize, prefix: &str) -> Option<String> {
        self.lines.lock().unwrap().iter().skip(mark).find_map(|l| {
            let l = match l.strip_prefix("test ") {
                Some(rest) => rest.split_once(" ... ").map_or(l.as_str(), |x| x.1),
                None => l,
            };
            l.starts_with(prefix).then(|| l.to_string())
        })
    }

    /// Number of lines printed so far (for [`ChildProc::wait_line_since`]).
    pub fn mark(&self) -> usize {
        self.lines.lock().unwrap().len()
    }

    /// Waits for a line starting with `prefix`; panics (with the child's
    /// output) after `secs` or if the child exits first.
    pub fn wait_line(&mut self, prefix: &str, secs: u64) -> String {
        self.wait_line_since(0, prefix, secs)
    }

    /// Like [`ChildProc::wait_line`], among the lines printed after `mark`.
    pub fn wait_line_since(&mut self, mark: usize, prefix: &str, secs: u64) -> String {
        let end = Instant::now() + Duration::from_secs(secs);
        loop {
            if let Some(l) = self.find_line_since(mark, prefix) {
                return l;
            }
            if let Some(st) = self.child.try_wait().unwrap() {
                std::thread::sleep(Duration::from_millis(50)); // let the reader finish
                if let Some(l) = self.find_line_since(mark, prefix) {
                    return l;
                }
                panic!(
                    "{} exited ({st}) before printing {prefix:?}; output:\n{}",
                    self.name,
                    self.output()
                );
            }
            if Instant::now() > end {
                panic!(
                    "{}: no {prefix:?} within {secs} s; output:\n{}",
                    self.name,
                    self.output()
                );
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Writes a command line to the child's stdin (see [`read_command`]).
    pub fn command(&mut self, line: &str) {
        let s = self.stdin.as_mut().expect("stdin");
        writeln!(s, "{line}").unwrap();
        s.flush().unwrap();
    }

    /// Sends signal `sig` to the child.
    pub fn signal(&self, sig: i32) {
        // SAFETY: kill(2) on our own child's pid.
        let r = unsafe { libc::kill(self.pid(), sig) };
        assert_eq!(r, 0, "kill({}, {sig})", self.pid());
    }

    /// SIGSTOP, then waits until every thread of the child is stopped (the
    /// signal takes effect asynchronously).
    pub fn freeze(&self) {
        self.signal(libc::SIGSTOP);
        let end = Instant::now() + Duration::from_secs(10);
        let task_dir = format!("/proc/{}/task", self.pid());
        loop {
            let all_stopped = std::fs::read_dir(&task_dir)
                .unwrap()
                .filter_map(|e| std::fs::read_to_string(e.ok()?.path().join("stat")).ok())
                .all(|stat| {
                    // "pid (comm) S ...": the state follows the last ')'.
                    let state = stat.rsplit(')').next().unwrap_or("").trim_start();
                    state.starts_with('T') || state.starts_with('t')
                });
            if all_stopped {
                return;
            }
            assert!(Instant::now() < end, "{} did not stop", self.name);
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// SIGKILL, then reaps the child.
    pub fn kill9(&mut self) {
        self.signal(libc::SIGKILL);
        let _ = self.child.wait();
    }

    /// Waits (at most `secs`) for the child to exit successfully; returns
    /// its output.
    pub fn finish(mut self, secs: u64) -> String {
        let end = Instant::now() + Duration::from_secs(secs);
        self.stdin.take();
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                if let Some(r) = self.reader.take() {
                    let _ = r.join();
                }
                let out = self.output();
                assert!(st.success(), "{} failed ({st}); output:\n{out}", self.name);
                return out;
            }
            if Instant::now() > end {
                let _ = self.child.kill();
                panic!(
                    "{} did not finish in {secs} s; output:\n{}",
                    self.name,
                    self.output()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for ChildProc {
    fn drop(&mut self) {
        // A failing test must not leave node processes behind.
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Runs `test` as a child process (see [`ChildProc`]).
pub fn spawn_child(test: &str, vars: &[(&str, String)]) -> ChildProc {
    ChildProc::spawn(test, vars)
}

/// Waits for a child to succeed; returns its output.
pub fn wait_child(c: ChildProc, secs: u64) -> String {
    c.finish(secs)
}

/// In a child: blocks until the parent writes a line starting with `what`
/// (see [`ChildProc::command`]); returns the line.
pub fn read_command(what: &str) -> String {
    let mut line = String::new();
    loop {
        line.clear();
        let n = std::io::stdin().read_line(&mut line).unwrap();
        assert!(n > 0, "parent closed stdin while waiting for {what:?}");
        if line.starts_with(what) {
            return line.trim_end().to_string();
        }
    }
}

/// In a child: logs dxnet's messages (info and above) to stderr if
/// `DXNET_TEST_LOG` is set.
pub fn init_child_log() {
    if std::env::var("DXNET_TEST_LOG").is_ok() {
        let _ = tracing_subscriber::fmt()
            .with_writer(std::io::stderr)
            .with_max_level(tracing_subscriber::filter::LevelFilter::INFO)
            .try_init();
    }
}

/// In a child: the next command line from the parent.
pub fn next_command() -> String {
    let mut line = String::new();
    let n = std::io::stdin().read_line(&mut line).unwrap();
    assert!(n > 0, "parent closed stdin");
    line.trim_end().to_string()
}

/// Calls `f` until it stops failing with "unreachable" or "timeout" (peers
/// still starting), at most 60 s.
pub fn until_reachable<T>(what: &str, mut f: impl FnMut() -> dxnet::Result<T>) -> T {
    let end = Instant::now() + Duration::from_secs(60);
    loop {
        match f() {
            Ok(v) => return v,
            Err(Error::Unreachable(..)) | Err(Error::Timeout(_)) if Instant::now() < end => {
                std::thread::sleep(Duration::from_millis(20))
            }
            Err(e) => panic!("{what}: {e}"),
        }
    }
}

fn status_kib(field: &str) -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = s.lines().find(|l| l.starts_with(field)).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// Resident set size of this process (KiB).
pub fn rss_kib() -> u64 {
    status_kib("VmRSS:")
}

/// Peak resident set size of this process (KiB).
pub fn hwm_kib() -> u64 {
    status_kib("VmHWM:")
}

/// Threads of this process.
pub fn threads() -> u64 {
    status_kib("Threads:")
}

/// Milliseconds since the Unix epoch (comparable between processes).
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// The `key=value` field of a child's output line (`key=` given).
pub fn field<T: std::str::FromStr>(out: &str, key: &str) -> T
where
    T::Err: std::fmt::Debug,
{
    out.split_whitespace()
        .find_map(|w| w.strip_prefix(key))
        .unwrap_or_else(|| panic!("{key} in {out}"))
        .parse()
        .unwrap()
}
