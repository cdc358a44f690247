//! MPI as external bindings (`mpi-tcp`, `mpi-shm` on Open MPI; `mpich-tcp`,
//! `mpich-shm` on MPICH), both from the distribution's packages, running
//! dxnet-bench's operations the way the OSU micro-benchmarks do
//! (`mpi/osu.c`, built with each implementation's `mpicc` at the first
//! run), one rank per node, so their numbers sit in the same tables, CSV
//! and plots as dxnet's.
//!
//! * `throughput` `uni`: `osu_bw` — windows of `mpi_window` `MPI_Isend`s,
//!   the receiver's 4-byte ack after each window;
//! * `throughput` `bi`: `osu_bibw` — both sides post a window of receives
//!   and sends, then wait;
//! * `all_to_all`: per window up to `mpi_window` messages to and from every
//!   other rank, dxnet-bench's round-robin destinations;
//! * `latency` / `pingpong`: `osu_latency`'s blocking send and receive of
//!   the echo (latency RTT/2, pingpong the RTT).
//!
//! With several threads per node the ranks run `MPI_THREAD_MULTIPLE`, and
//! thread j exchanges with thread j of its peers (its own tag).
//!
//! `mpi-tcp` is the ob1 point-to-point layer over the TCP BTL on `lo` (what
//! MPI does between hosts on Ethernet); `mpi-shm` over shared memory
//! (vader), for reference. `mpich-tcp` is MPICH's ch4 device over UCX
//! restricted to its TCP transport on `lo` (`UCX_TLS=tcp,self`,
//! `UCX_NET_DEVICES`, MPICH's shared memory off); `mpich-shm` MPICH as it
//! runs ranks on one host (its shared memory). The ranks' CPU time of the measured phase is
//! summed; `mpi-tcp` reads `lo`'s `tx_bytes` around it (`wire_iface`
//! overrides the interface). Every message carries its index + 1; each
//! thread's received stamps must add up to what was sent to it, else the
//! run fails. A window holds at most 16 MiB per thread and direction (fewer
//! messages at large sizes). A run is stopped after `timeout_s`, `mpirun`
//! and its ranks together.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};

use super::BindingKind;
use crate::config::{GroupKey, Mode, Operation, Params, RunSpec};
use crate::metrics::{new_histogram, record_ns, LatencyStats, Record};

/// The benchmark program's source.
const OSU_SOURCE: &str = include_str!("../../mpi/osu.c");

/// An MPI implementation: its compiler wrapper and launcher.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mpi {
    /// Open MPI (Debian: openmpi-bin, libopenmpi-dev).
    Open,
    /// MPICH (Debian: mpich, libmpich-dev).
    Mpich,
}

/// Whether `name` is an executable in a directory of `PATH`.
fn on_path(name: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(name).is_file()))
}

impl Mpi {
    /// The implementation a binding runs on.
    pub fn of(kind: BindingKind) -> Result<Mpi> {
        Ok(match kind {
            BindingKind::MpiTcp | BindingKind::MpiShm => Mpi::Open,
            BindingKind::MpichTcp | BindingKind::MpichShm => Mpi::Mpich,
            other => bail!("{} is not an MPI binding", other.name()),
        })
    }

    /// Its suffixed command `base` (Debian installs both side by side and
    /// points the plain names at one of them), else the plain name.
    fn command(self, base: &str) -> String {
        let suffixed = match self {
            Mpi::Open => format!("{base}.openmpi"),
            Mpi::Mpich => format!("{base}.mpich"),
        };
        if on_path(&suffixed) || self == Mpi::Mpich {
            suffixed
        } else {
            base.to_string()
        }
    }

    fn packages(self) -> &'static str {
        match self {
            Mpi::Open => "Debian: openmpi-bin libopenmpi-dev",
            Mpi::Mpich => "Debian: mpich libmpich-dev",
        }
    }
}

/// The `mpirun` options that pick a binding's transport (Open MPI).
pub fn transport_options(kind: BindingKind) -> Result<&'static [&'static str]> {
    Ok(match kind {
        BindingKind::MpiTcp => &[
            "--mca",
            "pml",
            "ob1",
            "--mca",
            "btl",
            "self,tcp",
            "--mca",
            "btl_tcp_if_include",
            "lo",
        ],
        BindingKind::MpiShm => &["--mca", "pml", "ob1", "--mca", "btl", "self,vader"],
        BindingKind::MpichTcp | BindingKind::MpichShm => &[],
        other => bail!("{} is not an MPI binding", other.name()),
    })
}

/// The environment that picks a binding's transport (MPICH over UCX):
/// TCP on `iface` only, MPICH's shared memory off.
pub fn transport_env(kind: BindingKind, iface: &str) -> Vec<(&'static str, String)> {
    match kind {
        BindingKind::MpichTcp => vec![
            ("UCX_TLS", "tcp,self".into()),
            ("UCX_NET_DEVICES", iface.into()),
            ("MPIR_CVAR_CH4_SHM_ENABLE", "0".into()),
        ],
        _ => Vec::new(),
    }
}

/// How long ranks may take to leave once rank 0 printed the complete
/// output (`END`): MPICH over UCX's TCP transport now and then hangs in
/// `MPI_Finalize` (about one run in three here, Debian's MPICH 4.0.2).
const EXIT_GRACE: Duration = Duration::from_secs(3);

/// Whether the file at `path` ends with the program's `END` line.
fn output_complete(path: &std::path::Path) -> bool {
    use std::io::{Read, Seek, SeekFrom};
    let Ok(mut f) = std::fs::File::open(path) else {
        return false;
    };
    let mut tail = [0u8; 4];
    f.seek(SeekFrom::End(-4)).is_ok() && f.read_exact(&mut tail).is_ok() && &tail == b"END\n"
}

/// An Open MPI program from `source`; see [`program_for`].
pub fn program(name: &str, source: &str) -> Result<PathBuf> {
    program_for(Mpi::Open, name, source)
}

/// An MPI program from `source`, compiled with `mpi`'s `mpicc` into the
/// temporary directory once per version of the source and compiler.
pub fn program_for(mpi: Mpi, name: &str, source: &str) -> Result<PathBuf> {
    use std::hash::{Hash, Hasher};
    let mpicc = mpi.command("mpicc");
    let mut h = std::collections::hash_map::DefaultHasher::new();
    source.hash(&mut h);
    mpicc.hash(&mut h);
    // Per user: another user's program is never run from a shared path.
    // SAFETY: getuid has no preconditions.
    let uid = unsafe { libc::getuid() };
    let dir = std::env::temp_dir().join(format!("dxnet-bench-mpi-{uid}-{:016x}", h.finish()));
    let exe = dir.join(name);
    if exe.exists() {
        return Ok(exe);
    }
    std::fs::create_dir_all(&dir)?;
    let src = dir.join(format!("{name}.c"));
    std::fs::write(&src, source)?;
    let tmp = dir.join(format!("{name}.{}", std::process::id()));
    let out = Command::new(&mpicc)
        .args(["-O2", "-pthread", "-o"])
        .arg(&tmp)
        .arg(&src)
        .output()
        .with_context(|| format!("running {mpicc} ({})", mpi.packages()))?;
    if !out.status.success() {
        bail!(
            "{mpicc} failed on {} ({}): {}",
            src.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    std::fs::rename(&tmp, &exe)?;
    Ok(exe)
}

/// Open MPI's `mpirun`; see [`mpirun_for`].
pub fn mpirun(ranks: usize) -> Command {
    mpirun_for(Mpi::Open, ranks)
}

/// The launcher of `mpi` for `ranks` ranks on this host: allowed as root
/// (containers, VMs) and with more ranks than cores (MPICH's `mpiexec`
/// allows both anyway).
pub fn mpirun_for(mpi: Mpi, ranks: usize) -> Command {
    let mut cmd;
    match mpi {
        Mpi::Open => {
            cmd = Command::new(mpi.command("mpirun"));
            cmd.env("OMPI_ALLOW_RUN_AS_ROOT", "1")
                .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
                .args(["--oversubscribe", "-np", &ranks.to_string()]);
        }
        Mpi::Mpich => {
            cmd = Command::new(mpi.command("mpiexec"));
            cmd.args(["-n", &ranks.to_string()]);
        }
    }
    cmd.stdin(Stdio::null());
    cmd
}

/// The launcher's binding of ranks, as dxnet's node processes are placed:
/// with `--bind-nodes` and no more ranks than cores, each rank on its own
/// share of the cores (`cores / ranks` cores, as
/// [`crate::affinity::share`] gives a node process); otherwise unbound
/// (Open MPI binds up to two ranks to a core each by default). Nothing when
/// `mpirun_options` name a binding themselves.
fn bind_options(mpi: Mpi, ranks: usize, params: &Params) -> Result<Vec<String>> {
    if params.mpirun_options.contains("bind-to") {
        return Ok(Vec::new());
    }
    let cores = crate::affinity::cores_of(&crate::affinity::allowed_cpus()?).len();
    let per_rank = cores / ranks.max(1);
    let opts: &[&str] = match (mpi, params.bind_nodes && per_rank >= 1) {
        (Mpi::Open, false) => &["--bind-to", "none"],
        (Mpi::Mpich, false) => &["-bind-to", "none"],
        (Mpi::Open, true) if per_rank == 1 => &["--bind-to", "core"],
        (Mpi::Open, true) => {
            return Ok(vec![
                "--map-by".into(),
                format!("slot:PE={per_rank}"),
                "--bind-to".into(),
                "core".into(),
            ])
        }
        (Mpi::Mpich, true) => return Ok(vec!["-bind-to".into(), format!("core:{per_rank}")]),
    };
    Ok(opts.iter().map(|o| o.to_string()).collect())
}

/// Whether the MPI program runs `op` (its point-to-point operations).
pub fn supports(op: Operation) -> bool {
    matches!(
        op,
        Operation::Throughput | Operation::Latency | Operation::Pingpong | Operation::AllToAll
    )
}

/// What rank 0 printed.
#[derive(Debug, Default, PartialEq)]
struct Output {
    messages: u64,
    elapsed_s: f64,
    cpu_s: f64,
    wire_bytes: u64,
    sum_ok: bool,
    /// Round trips, ns.
    samples: Vec<u64>,
}

fn parse(out: &str) -> Result<Output> {
    let mut o = Output::default();
    let mut seen = false;
    for l in out.lines() {
        let l = l.trim();
        if let Some(s) = l.strip_prefix("S ") {
            o.samples.push(
                s.parse()
                    .with_context(|| format!("bad sample line {l:?}"))?,
            );
        } else if let Some(r) = l.strip_prefix("RESULT ") {
            seen = true;
            for kv in r.split_whitespace() {
                let (k, v) = kv
                    .split_once('=')
                    .ok_or_else(|| anyhow!("bad result {r:?}"))?;
                let bad = || format!("bad {k} in {r:?}");
                match k {
                    "messages" => o.messages = v.parse().with_context(bad)?,
                    "elapsed_s" => o.elapsed_s = v.parse().with_context(bad)?,
                    "cpu_s" => o.cpu_s = v.parse().with_context(bad)?,
                    "wire_bytes" => o.wire_bytes = v.parse().with_context(bad)?,
                    "sum_ok" => o.sum_ok = v == "1",
                    _ => {}
                }
            }
        }
    }
    if !seen {
        bail!("no RESULT line in the MPI program's output");
    }
    if !o.elapsed_s.is_finite() || o.elapsed_s <= 0.0 {
        bail!("the MPI program reported {} s", o.elapsed_s);
    }
    Ok(o)
}

/// The messages (or round trips) a run must report.
fn expected(key: &GroupKey, run: &RunSpec) -> u64 {
    (0..key.nodes as u16)
        .map(|id| {
            if run.operation.is_latency() {
                // Each initiator's round trips.
                if id & 1 == 0 {
                    run.count
                } else {
                    0
                }
            } else {
                crate::ops::expected(
                    run.operation,
                    run.mode,
                    id,
                    key.nodes,
                    run.count,
                    key.threads,
                )
            }
        })
        .sum()
}

/// One measured repetition of an MPI binding as a [`Record`].
pub fn measure(key: &GroupKey, run: &RunSpec, repetition: u32, params: &Params) -> Result<Record> {
    let kind = BindingKind::parse(&key.binding)?;
    if !supports(run.operation) {
        bail!("{} does not run {}", kind.name(), run.operation);
    }
    let mpi = Mpi::of(kind)?;
    let exe = program_for(mpi, "bench-mpi", OSU_SOURCE)?;
    let tcp = matches!(kind, BindingKind::MpiTcp | BindingKind::MpichTcp);
    let iface = match () {
        _ if !tcp => "-".to_string(),
        _ if params.wire_iface.is_empty() => "lo".to_string(),
        _ => params.wire_iface.clone(),
    };
    let mode = if run.mode == Mode::Bi { "bi" } else { "uni" };
    let mut cmd = mpirun_for(mpi, key.nodes);
    cmd.envs(transport_env(kind, &iface))
        .args(transport_options(kind)?)
        .args(bind_options(mpi, key.nodes, params)?)
        .args(params.mpirun_options.split_whitespace())
        .arg(&exe)
        .args([
            run.operation.to_string(),
            mode.to_string(),
            run.size.to_string(),
            run.count.to_string(),
            run.warmup.to_string(),
            params.mpi_window.to_string(),
            key.threads.to_string(),
            iface,
        ]);
    let timeout = Duration::from_secs(params.timeout_s.max(1).saturating_mul(2).saturating_add(30));
    let out = run_with_timeout(cmd, timeout, mpi)?;
    let o = parse(&out)?;
    let want = expected(key, run);
    if o.messages != want {
        bail!("MPI: {} messages arrived, {want} expected", o.messages);
    }
    if !o.sum_ok {
        bail!("MPI: the messages' contents differ from what was sent");
    }
    Ok(record(key, run, repetition, &o))
}

fn record(key: &GroupKey, run: &RunSpec, repetition: u32, o: &Output) -> Record {
    let size = run.size as u64;
    let lat_us = run.operation.is_latency().then(|| {
        let half = run.operation == Operation::Latency;
        let mut h = new_histogram();
        for &ns in &o.samples {
            record_ns(&mut h, if half { ns / 2 } else { ns });
        }
        LatencyStats::from_hist(&h)
    });
    let payload = if run.operation.is_latency() {
        2 * o.messages * size
    } else {
        o.messages * size
    };
    let msgs_per_sec = o.messages as f64 / o.elapsed_s;
    let wire_bytes = (o.wire_bytes > 0).then_some(o.wire_bytes);
    Record {
        operation: run.operation,
        mode: run.mode,
        binding: key.binding.clone(),
        size: run.size,
        threads: key.threads,
        handlers: key.handlers,
        nodes: key.nodes,
        repetition,
        count: run.count,
        messages: o.messages,
        elapsed_s: o.elapsed_s,
        msgs_per_sec,
        bytes_per_sec: msgs_per_sec * run.size as f64,
        lat_us: lat_us.flatten(),
        cpu_s: o.cpu_s,
        proc_cpu_s: Vec::new(),
        cpu_us_per_op: o.cpu_s * 1e6 / o.messages.max(1) as f64,
        rate: 0,
        late_us: None,
        wire_bytes,
        wire_overhead: wire_bytes
            .filter(|_| payload > 0)
            .map(|w| w as f64 / payload as f64),
        connections: Vec::new(),
        breakdown: None,
    }
}

/// Removes the files when dropped.
struct TempFiles(Vec<PathBuf>);

impl Drop for TempFiles {
    fn drop(&mut self) {
        for p in &self.0 {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// Runs `cmd` in a process group of its own, returns its stdout; stops the
/// whole group (`mpirun` and its ranks: SIGTERM, then SIGKILL) after
/// `timeout`.
fn run_with_timeout(mut cmd: Command, timeout: Duration, mpi: Mpi) -> Result<String> {
    use std::os::unix::process::CommandExt;
    use std::sync::atomic::{AtomicU64, Ordering};
    static RUN: AtomicU64 = AtomicU64::new(0);
    let stem = std::env::temp_dir().join(format!(
        "dxnet-bench-mpi-{}-{}",
        std::process::id(),
        RUN.fetch_add(1, Ordering::Relaxed)
    ));
    let (out_path, err_path) = (stem.with_extension("out"), stem.with_extension("err"));
    let _files = TempFiles(vec![out_path.clone(), err_path.clone()]);
    let mut child = cmd
        .process_group(0)
        .stdout(std::fs::File::create(&out_path)?)
        .stderr(std::fs::File::create(&err_path)?)
        .spawn()
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => {
                anyhow!("{:?} not found ({})", cmd.get_program(), mpi.packages())
            }
            _ => anyhow!("cannot start {:?}: {e}", cmd.get_program()),
        })?;
    let deadline = Instant::now() + timeout;
    let mut complete_at: Option<Instant> = None;
    let mut polls = 0u64;
    let status = loop {
        if let Some(st) = child.try_wait()? {
            break Ok(st);
        }
        polls += 1;
        if complete_at.is_none() && polls.is_multiple_of(20) && output_complete(&out_path) {
            complete_at = Some(Instant::now());
        }
        let hung_at_exit = complete_at.is_some_and(|t| t.elapsed() >= EXIT_GRACE);
        if hung_at_exit || Instant::now() >= deadline {
            let group = child.id() as libc::pid_t;
            // SAFETY: kill(2) on the process group our unreaped child leads
            // (its id cannot name another group while it is not reaped).
            unsafe { libc::kill(-group, libc::SIGTERM) };
            let grace = Instant::now() + Duration::from_secs(5);
            while child.try_wait()?.is_none() && Instant::now() < grace {
                std::thread::sleep(Duration::from_millis(20));
            }
            // SAFETY: as above; ranks left behind by mpirun die too.
            unsafe { libc::kill(-group, libc::SIGKILL) };
            let _ = child.wait();
            if hung_at_exit {
                eprintln!(
                    "note: MPI ranks still running {EXIT_GRACE:?} after their complete output; stopped"
                );
                let out = std::fs::read_to_string(&out_path).unwrap_or_default();
                return Ok(out);
            }
            break Err(anyhow!("the MPI run took longer than {timeout:?}"));
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let out = std::fs::read_to_string(&out_path).unwrap_or_default();
    let err = std::fs::read_to_string(&err_path).unwrap_or_default();
    let status = status?;
    if !status.success() {
        let tail: Vec<&str> = err.lines().rev().take(12).collect();
        bail!(
            "mpirun failed ({status}): {}",
            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
        );
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const OUT: &str =
        "RESULT messages=2 elapsed_s=0.5 cpu_s=1.25 wire_bytes=300 sum_ok=1\nS 1000\nS 3000\n";

    fn key(binding: &str) -> GroupKey {
        GroupKey {
            binding: binding.into(),
            nodes: 2,
            threads: 1,
            handlers: 0,
        }
    }

    fn run(op: Operation) -> RunSpec {
        RunSpec {
            operation: op,
            mode: Mode::Uni,
            size: 64,
            count: 2,
            warmup: 0,
            repetitions: 1,
            rate: 0,
        }
    }

    #[test]
    fn parses_the_result_and_samples() {
        let o = parse(OUT).unwrap();
        assert_eq!(o.messages, 2);
        assert_eq!(o.samples, vec![1000, 3000]);
        assert!(o.sum_ok && o.wire_bytes == 300 && o.cpu_s == 1.25);
        assert!(parse("S 1\n").is_err());
        assert!(parse("RESULT messages=x").is_err());
        assert!(parse("RESULT messages=1 elapsed_s=0").is_err());
        assert!(!parse(&OUT.replace("sum_ok=1", "sum_ok=0")).unwrap().sum_ok);
    }

    #[test]
    fn latency_is_half_the_round_trip_pingpong_all_of_it() {
        let o = parse(OUT).unwrap();
        let lat = record(&key("mpi-tcp"), &run(Operation::Latency), 0, &o);
        let pp = record(&key("mpi-tcp"), &run(Operation::Pingpong), 0, &o);
        let (l, p) = (lat.lat_us.unwrap(), pp.lat_us.unwrap());
        assert!((p.max / l.max - 2.0).abs() < 0.01, "{l:?} {p:?}");
        assert_eq!(pp.msgs_per_sec, 4.0);
        // Both directions' payload: 300 / (2 * 2 * 64).
        assert_eq!(pp.wire_overhead, Some(300.0 / 256.0));
    }

    #[test]
    fn expected_counts_follow_the_roles() {
        let mut r = run(Operation::Throughput);
        r.count = 1000;
        assert_eq!(expected(&key("mpi-tcp"), &r), 1000);
        r.mode = Mode::Bi;
        assert_eq!(expected(&key("mpi-tcp"), &r), 2000);
        let lat = run(Operation::Pingpong);
        assert_eq!(expected(&key("mpi-tcp"), &lat), 2);
        let mut a2a = run(Operation::AllToAll);
        a2a.count = 999;
        let k = GroupKey {
            nodes: 4,
            ..key("mpi-tcp")
        };
        assert_eq!(expected(&k, &a2a), 4 * 999);
    }
}
