//! perftest's RC benchmarks as external bindings (`ib_send_bw`,
//! `ib_send_lat`, and for the one-sided operations `ib_write_bw`,
//! `ib_write_lat`, `ib_read_bw`, `ib_read_lat`), so that their numbers sit
//! in the same `results.json`, tables and plots as the bindings measured
//! through [`Binding`](super::Binding).
//!
//! The coordinator runs, per measured repetition, the perftest server and
//! then its client against `127.0.0.1` (the endpoint exchange; the data goes
//! over the RDMA device), both on this host:
//!
//! * `ib_send_bw -s SIZE -n COUNT` for `throughput` `uni` (2 nodes, 1
//!   thread): messages/s from the client's report (`MsgRate`, or `BW
//!   average` in MiB/s where that is more precise: above ~10 KiB);
//! * `ib_send_lat -s SIZE -n COUNT -H` for `pingpong` and `latency`: `-H`
//!   prints every sample (RTT/2, µs); they go into the usual histogram, as
//!   full round trips (×2) for `pingpong` and one-way for `latency`.
//! * `ib_write_bw` / `ib_read_bw` like `ib_send_bw` for `rdma_write` /
//!   `rdma_read`, `uni`, or `bi` with `-b` (its report sums both
//!   directions); `ib_write_lat -H` (a ping-pong of writes, RTT/2
//!   per sample: recorded ×2, the time a write takes to be acknowledged)
//!   for `rdma_write_lat`, `ib_read_lat -H` (a read's full latency) for
//!   `rdma_read_lat`.
//!
//! Device, port and GID index come from `params.rdma` or `RDMA_DEV`,
//! `RDMA_PORT`, `RDMA_GID_INDEX`. perftest does its own warm-up; ours is
//! skipped. CPU time is both processes' user+sys (`RUSAGE_CHILDREN`); wire
//! bytes are not counted. A run that fails or prints non-finite numbers
//! (perftest's clock under emulation) is tried once more on a fresh port.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};

use super::BindingKind;
use crate::config::{GroupKey, Operation, Params, PerftestParams, RdmaTarget, RunSpec};
use crate::metrics::{new_histogram, record_ns, LatencyStats, Record};

/// Attempts per measured repetition.
const ATTEMPTS: u32 = 2;

/// The program of a perftest binding.
pub fn tool(kind: BindingKind) -> Result<&'static str> {
    Ok(match kind {
        BindingKind::IbSendBw
        | BindingKind::IbSendLat
        | BindingKind::IbWriteBw
        | BindingKind::IbWriteLat
        | BindingKind::IbReadBw
        | BindingKind::IbReadLat => kind.name(),
        other => bail!("{} is not a perftest binding", other.name()),
    })
}

/// The arguments (server side; the client adds the server address).
pub fn args(
    kind: BindingKind,
    run: &RunSpec,
    t: &RdmaTarget,
    depths: PerftestParams,
    tcp_port: u16,
) -> Vec<String> {
    let mut a = Vec::new();
    if let Some(d) = &t.device {
        a.extend(["-d".to_string(), d.clone()]);
    }
    a.extend(["-i".to_string(), t.port.to_string()]);
    if let Some(g) = t.gid_index {
        a.extend(["-x".to_string(), g.to_string()]);
    }
    a.extend([
        "-F".to_string(),
        "-s".to_string(),
        run.size.to_string(),
        "-n".to_string(),
        run.count.to_string(),
        "-p".to_string(),
        tcp_port.to_string(),
    ]);
    if !is_bw(kind) {
        a.push("-H".to_string());
    }
    if is_bw(kind) && depths.tx_depth > 0 {
        a.extend(["-t".to_string(), depths.tx_depth.to_string()]);
    }
    if kind == BindingKind::IbSendBw && depths.rx_depth > 0 {
        a.extend(["-r".to_string(), depths.rx_depth.to_string()]);
    }
    if run.mode == crate::config::Mode::Bi {
        // Both sides send at once; the report sums both directions.
        a.push("-b".to_string());
    }
    a
}

/// Whether the program measures bandwidth (else latency samples).
fn is_bw(kind: BindingKind) -> bool {
    matches!(
        kind,
        BindingKind::IbSendBw | BindingKind::IbWriteBw | BindingKind::IbReadBw
    )
}

/// Messages/s from `ib_send_bw`'s report line
/// `#bytes #iterations BW_peak BW_average[MiB/s] MsgRate[Mpps]`.
pub fn parse_bw(out: &str, size: usize) -> Result<f64> {
    let mut lines = out.lines().skip_while(|l| !l.contains("#bytes"));
    lines
        .next()
        .ok_or_else(|| anyhow!("no '#bytes' header in the ib_send_bw output"))?;
    let line = lines
        .find(|l| !l.trim().is_empty())
        .ok_or_else(|| anyhow!("no result line in the ib_send_bw output"))?;
    let f: Vec<f64> = line
        .split_whitespace()
        .map(|x| x.parse::<f64>())
        .collect::<Result<_, _>>()
        .with_context(|| format!("bad ib_send_bw result line {line:?}"))?;
    if f.len() < 5 || f.iter().any(|x| !x.is_finite()) {
        bail!("bad ib_send_bw result line {line:?}");
    }
    // MsgRate has 6 decimals (1 msg/s); BW average 2 decimals of MiB/s,
    // i.e. 10486/size msg/s: finer above ~10 KiB.
    let from_rate = f[4] * 1e6;
    let from_bw = f[3] * 1_048_576.0 / size.max(1) as f64;
    let mps = if size > 10_486 { from_bw } else { from_rate };
    if mps <= 0.0 {
        bail!("ib_send_bw reported no messages: {line:?}");
    }
    Ok(mps)
}

/// The samples `ib_send_lat -H` prints after `#, usec` (`N, value` lines;
/// one-way latency in µs).
pub fn parse_lat_samples(out: &str) -> Result<Vec<f64>> {
    let mut v = Vec::new();
    let mut in_samples = false;
    for l in out.lines() {
        let l = l.trim();
        if !in_samples {
            in_samples = l.starts_with("#, usec");
            continue;
        }
        let Some((i, x)) = l.split_once(',') else {
            break;
        };
        let (Ok(_), Ok(x)) = (i.trim().parse::<u64>(), x.trim().parse::<f64>()) else {
            break;
        };
        if !x.is_finite() || x < 0.0 {
            bail!("ib_send_lat printed a non-finite sample {l:?}");
        }
        v.push(x);
    }
    if v.is_empty() {
        bail!("no samples ('#, usec' list) in the ib_send_lat output");
    }
    Ok(v)
}

/// User + system seconds of all waited-for children so far.
fn children_cpu_s() -> f64 {
    // SAFETY: getrusage only writes into the zeroed struct we pass.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    let rc = unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, &mut ru) };
    if rc != 0 {
        return 0.0;
    }
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// Whether something listens on TCP `port` (perftest's server).
fn listening(port: u16) -> bool {
    let needle = format!(":{port:04X} ");
    ["/proc/net/tcp", "/proc/net/tcp6"].iter().any(|f| {
        std::fs::read_to_string(f).is_ok_and(|t| {
            t.lines().skip(1).any(|l| {
                let mut it = l.split_whitespace().skip(1);
                let (Some(local), Some(_remote), Some(st)) = (it.next(), it.next(), it.next())
                else {
                    return false;
                };
                st == "0A" && format!("{local} ").ends_with(&needle)
            })
        })
    })
}

fn log_path(tool: &str, port: u16, side: &str) -> PathBuf {
    std::env::temp_dir().join(format!(
        "dxnet-bench-{}-{tool}-{port}-{side}.log",
        std::process::id()
    ))
}

fn spawn(tool: &str, args: &[String], log: &PathBuf) -> Result<Child> {
    let f =
        std::fs::File::create(log).with_context(|| format!("cannot write {}", log.display()))?;
    Command::new(tool)
        .args(args)
        .stdin(Stdio::null())
        .stdout(f.try_clone()?)
        .stderr(f)
        .spawn()
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => {
                anyhow!("{tool} not found (perftest; Debian: apt-get install perftest)")
            }
            _ => anyhow!("cannot start {tool}: {e}"),
        })
}

/// Waits for `c` until `deadline`, then kills it.
fn wait(c: &mut Child, deadline: Instant) -> Result<std::process::ExitStatus> {
    loop {
        if let Some(st) = c.try_wait()? {
            return Ok(st);
        }
        if Instant::now() >= deadline {
            let _ = c.kill();
            let _ = c.wait();
            bail!("timed out");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn tail(path: &PathBuf) -> String {
    let t = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = t.lines().collect();
    lines[lines.len().saturating_sub(8)..].join("\n")
}

/// Runs server and client once; returns the client's output.
fn run_pair(tool: &str, args: &[String], port: u16, timeout: Duration) -> Result<String> {
    let deadline = Instant::now() + timeout;
    let (slog, clog) = (
        log_path(tool, port, "server"),
        log_path(tool, port, "client"),
    );
    let mut server = spawn(tool, args, &slog)?;
    let result = (|| -> Result<String> {
        while !listening(port) {
            if let Some(st) = server.try_wait()? {
                bail!("{tool} server exited early ({st}): {}", tail(&slog));
            }
            if Instant::now() >= deadline {
                bail!("{tool} server did not listen on port {port}");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let mut cargs = args.to_vec();
        cargs.push("127.0.0.1".into());
        let mut client = spawn(tool, &cargs, &clog)?;
        let cst = wait(&mut client, deadline).with_context(|| format!("{tool} client"))?;
        let sst = wait(&mut server, deadline).with_context(|| format!("{tool} server"))?;
        if !cst.success() || !sst.success() {
            bail!(
                "{tool} failed (client {cst}, server {sst}):\n{}\n{}",
                tail(&clog),
                tail(&slog)
            );
        }
        Ok(std::fs::read_to_string(&clog)?)
    })();
    if result.is_err() {
        let _ = server.kill();
        let _ = server.wait();
    }
    let _ = std::fs::remove_file(&slog);
    let _ = std::fs::remove_file(&clog);
    result
}

/// One measured repetition of a perftest binding as a [`Record`]; `port`
/// and `port + 1` are used for the endpoint exchange.
pub fn measure(
    key: &GroupKey,
    run: &RunSpec,
    repetition: u32,
    params: &Params,
    port: u16,
) -> Result<Record> {
    let kind = BindingKind::parse(&key.binding)?;
    let tool = tool(kind)?;
    let target = params.rdma.resolve();
    let timeout = Duration::from_secs(params.timeout_s.max(1) + 30);
    let mut last_err = None;
    for attempt in 0..ATTEMPTS {
        let p = port.wrapping_add(attempt as u16);
        let cpu0 = children_cpu_s();
        let r = run_pair(
            tool,
            &args(kind, run, &target, params.perftest, p),
            p,
            timeout,
        )
        .and_then(|out| {
            let cpu_s = children_cpu_s() - cpu0;
            record(kind, key, run, repetition, &out, cpu_s)
        });
        match r {
            Ok(rec) => return Ok(rec),
            Err(e) => {
                if attempt + 1 < ATTEMPTS {
                    eprintln!("{tool} -s {}: {e:#}; trying once more", run.size);
                }
                last_err = Some(e);
            }
        }
    }
    Err(last_err.unwrap_or_else(|| anyhow!("{tool}: no attempt")))
}

fn record(
    kind: BindingKind,
    key: &GroupKey,
    run: &RunSpec,
    repetition: u32,
    out: &str,
    cpu_s: f64,
) -> Result<Record> {
    let size = run.size;
    let (messages, elapsed_s, msgs_per_sec, lat_us) = if is_bw(kind) {
        let mps = parse_bw(out, size)?;
        let ways = if run.mode == crate::config::Mode::Bi {
            2
        } else {
            1
        };
        let messages = ways * run.count;
        (messages, messages as f64 / mps, mps, None)
    } else {
        let one_way = parse_lat_samples(out)?;
        // pingpong records full round trips, latency one-way (RTT/2); a
        // write's latency is its round trip (ib_write_lat prints RTT/2),
        // a read's is what ib_read_lat prints.
        let factor = match run.operation {
            Operation::Pingpong | Operation::RdmaWriteLat => 2.0,
            _ => 1.0,
        };
        let mut h = new_histogram();
        for &us in &one_way {
            record_ns(&mut h, (us * factor * 1000.0).round() as u64);
        }
        // The time the samples took: ib_read_lat's are whole reads, the
        // others' halves of round trips.
        let per = if kind == BindingKind::IbReadLat {
            1.0
        } else {
            2.0
        };
        let rtt_s: f64 = one_way.iter().map(|us| per * us / 1e6).sum();
        let n = one_way.len() as u64;
        let mps = if rtt_s > 0.0 { n as f64 / rtt_s } else { 0.0 };
        (n, rtt_s, mps, LatencyStats::from_hist(&h))
    };
    Ok(Record {
        operation: run.operation,
        mode: run.mode,
        binding: key.binding.clone(),
        size,
        threads: key.threads,
        handlers: key.handlers,
        nodes: key.nodes,
        repetition,
        count: run.count,
        messages,
        elapsed_s,
        msgs_per_sec,
        bytes_per_sec: msgs_per_sec * size as f64,
        lat_us,
        cpu_s,
        proc_cpu_s: Vec::new(),
        cpu_us_per_op: cpu_s * 1e6 / messages.max(1) as f64,
        rate: 0,
        late_us: None,
        wire_bytes: None,
        wire_overhead: None,
        connections: Vec::new(),
        breakdown: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Mode;

    const BW: &str = "\
---------------------------------------------------------------------------------------
 #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]
 64         2000             2.93               0.56   \t\t   0.009224
---------------------------------------------------------------------------------------
";

    const LAT: &str = "\
 #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec] 
#, usec
1, 10.5
2, 11
3, 12.25
 64      3          10.50          12.25        11.00                11.25        0.72    12.25   12.25
";

    fn run(op: Operation, size: usize) -> RunSpec {
        RunSpec {
            operation: op,
            mode: Mode::Uni,
            size,
            count: 2000,
            warmup: 0,
            repetitions: 1,
            rate: 0,
        }
    }

    #[test]
    fn parses_bandwidth() {
        assert_eq!(parse_bw(BW, 64).unwrap(), 9224.0);
        let big = BW.replace(" 64 ", " 65536 ");
        // 0.56 MiB/s of 64 KiB messages
        assert!((parse_bw(&big, 65536).unwrap() - 8.96).abs() < 1e-9);
        assert!(parse_bw(&BW.replace("0.009224", "inf"), 64).is_err());
        assert!(parse_bw("nothing", 64).is_err());
    }

    #[test]
    fn parses_latency_samples() {
        assert_eq!(parse_lat_samples(LAT).unwrap(), vec![10.5, 11.0, 12.25]);
        assert!(parse_lat_samples("#, usec\n").is_err());
        assert!(parse_lat_samples("#, usec\n1, nan\n").is_err());
    }

    #[test]
    fn records_round_trips_in_full() {
        let key = GroupKey {
            binding: "ib_send_lat".into(),
            nodes: 2,
            threads: 1,
            handlers: 0,
        };
        let pp = record(
            BindingKind::IbSendLat,
            &key,
            &run(Operation::Pingpong, 64),
            0,
            LAT,
            0.1,
        )
        .unwrap();
        let l = pp.lat_us.unwrap();
        assert!((l.p50 - 22.0).abs() < 0.05, "{l:?}");
        assert_eq!(pp.messages, 3);
        let one_way = record(
            BindingKind::IbSendLat,
            &key,
            &run(Operation::Latency, 64),
            0,
            LAT,
            0.1,
        )
        .unwrap();
        assert!((one_way.lat_us.unwrap().p50 - 11.0).abs() < 0.05);
        assert_eq!(pp.msgs_per_sec, one_way.msgs_per_sec);
        let key = GroupKey {
            binding: "ib_send_bw".into(),
            ..key
        };
        let bw = record(
            BindingKind::IbSendBw,
            &key,
            &run(Operation::Throughput, 64),
            1,
            BW,
            0.2,
        )
        .unwrap();
        assert_eq!(bw.msgs_per_sec, 9224.0);
        assert_eq!(bw.bytes_per_sec, 9224.0 * 64.0);
        assert!(bw.lat_us.is_none() && bw.wire_overhead.is_none());
    }

    #[test]
    fn one_sided_programs_record_a_write_round_trip_and_a_whole_read() {
        let key = |b: &str| GroupKey {
            binding: b.into(),
            nodes: 2,
            threads: 1,
            handlers: 0,
        };
        let w = record(
            BindingKind::IbWriteLat,
            &key("ib_write_lat"),
            &run(Operation::RdmaWriteLat, 64),
            0,
            LAT,
            0.1,
        )
        .unwrap();
        assert!((w.lat_us.unwrap().p50 - 22.0).abs() < 0.05);
        let r = record(
            BindingKind::IbReadLat,
            &key("ib_read_lat"),
            &run(Operation::RdmaReadLat, 64),
            0,
            LAT,
            0.1,
        )
        .unwrap();
        assert!((r.lat_us.unwrap().p50 - 11.0).abs() < 0.05);
        // Three reads of 10.5 + 11 + 12.25 µs.
        assert!((r.elapsed_s - 33.75e-6).abs() < 1e-9, "{}", r.elapsed_s);
        let bw = record(
            BindingKind::IbReadBw,
            &key("ib_read_bw"),
            &run(Operation::RdmaRead, 64),
            0,
            BW,
            0.1,
        )
        .unwrap();
        assert_eq!(bw.msgs_per_sec, 9224.0);
        let t = RdmaTarget {
            device: None,
            port: 1,
            gid_index: None,
        };
        let a = args(
            BindingKind::IbWriteBw,
            &run(Operation::RdmaWrite, 64),
            &t,
            PerftestParams::default(),
            1,
        );
        assert!(!a.contains(&"-H".to_string()));
        let a = args(
            BindingKind::IbReadLat,
            &run(Operation::RdmaReadLat, 64),
            &t,
            PerftestParams::default(),
            1,
        );
        assert!(a.contains(&"-H".to_string()));
        assert_eq!(tool(BindingKind::IbReadBw).unwrap(), "ib_read_bw");
        assert!(tool(BindingKind::RawVerbs).is_err());
    }

    #[test]
    fn arguments() {
        let t = RdmaTarget {
            device: Some("rxe0".into()),
            port: 1,
            gid_index: Some(1),
        };
        let depths = PerftestParams {
            rx_depth: 2000,
            tx_depth: 20,
        };
        let a = args(
            BindingKind::IbSendLat,
            &run(Operation::Pingpong, 64),
            &t,
            depths,
            18515,
        );
        assert_eq!(
            a.join(" "),
            "-d rxe0 -i 1 -x 1 -F -s 64 -n 2000 -p 18515 -H"
        );
        // The report's depths: both for ib_send_bw, -t for the others.
        let mut bi = run(Operation::Throughput, 64);
        bi.mode = crate::config::Mode::Bi;
        let a = args(BindingKind::IbSendBw, &bi, &t, depths, 18515);
        assert!(a.join(" ").ends_with("-t 20 -r 2000 -b"), "{a:?}");
        let a = args(
            BindingKind::IbWriteBw,
            &run(Operation::RdmaWrite, 64),
            &t,
            depths,
            1,
        );
        assert!(a.join(" ").ends_with("-t 20"), "{a:?}");
    }
}
