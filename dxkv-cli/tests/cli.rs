//! The `dxkv` command end to end: `dxkv local` starts storage processes,
//! loads and runs a YCSB workload against them and reports every operation.

use std::process::Command;

/// A free port (with `n - 1` free after it) below the ephemeral range.
/// Each call gets its own range (tests run in parallel).
fn free_ports(n: u16) -> u16 {
    use std::sync::atomic::{AtomicU16, Ordering};
    static NEXT: AtomicU16 = AtomicU16::new(0);
    let _ = NEXT.compare_exchange(
        0,
        14_000 + (std::process::id() % 500) as u16 * 30,
        Ordering::SeqCst,
        Ordering::SeqCst,
    );
    loop {
        let p = NEXT.fetch_add(n, Ordering::SeqCst);
        if (0..n).all(|i| std::net::TcpListener::bind(("127.0.0.1", p + i)).is_ok()) {
            return p;
        }
    }
}

fn run_local(workload: &str, storage: u16, extra: &[&str]) -> serde_json::Value {
    static RUNS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let run = RUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("dxkv-cli-{}-{run}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("out.json");
    let out = Command::new(env!("CARGO_BIN_EXE_dxkv"))
        .args(["local", "--workload", workload])
        .args(["--records", "3000", "--operations", "6000"])
        .args(["--storage-nodes", &storage.to_string()])
        .args(["--port", &free_ports(8).to_string()])
        .arg("--json")
        .arg(&json)
        .args(extra)
        .args(if extra.contains(&"--threads") {
            &[][..]
        } else {
            &["--threads", "24"][..]
        })
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("ops/s with 24 threads"), "{stdout}");
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    v
}

/// The runs of a `dxkv local --json` output.
fn runs(v: &serde_json::Value) -> &Vec<serde_json::Value> {
    v["runs"].as_array().unwrap()
}

/// Checks the `phase` report of one run: `count` operations of the types
/// `ops`, none failed, every read found its record.
fn check(v: &serde_json::Value, phase: &str, count: u64, ops: &[&str]) {
    let r = v["reports"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["phase"] == phase)
        .unwrap_or_else(|| panic!("no {phase} report: {v}"));
    assert_eq!(r["operations"], count, "{r}");
    let mut sum = 0;
    for (op, s) in r["ops"].as_object().unwrap() {
        assert!(ops.contains(&op.as_str()), "unexpected {op}: {r}");
        assert_eq!(s["errors"], 0, "{r}");
        assert_eq!(s["not_found"], 0, "{op}: every key read was loaded: {r}");
        assert!(s["p50_us"].as_u64().unwrap() <= s["p99_us"].as_u64().unwrap());
        sum += s["ok"].as_u64().unwrap();
    }
    assert_eq!(sum, count);
}

#[test]
fn local_cluster_runs_paper_b_with_every_read_found() {
    let csv = std::env::temp_dir().join(format!("dxkv-cli-{}.csv", std::process::id()));
    let all = run_local("paper-b", 1, &["--csv", csv.to_str().unwrap()]);
    let v = &runs(&all)[0];
    let text = std::fs::read_to_string(&csv).unwrap();
    std::fs::remove_file(&csv).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert!(
        lines[0].starts_with(
            "workload,storage_nodes,benchmark_nodes,threads_per_node,round,binding,phase,threads,operation,ok"
        ),
        "{text}"
    );
    assert!(
        lines[1].starts_with("paper-b,1,1,24,1,dxkv,load,24,insert,3000,0,0,"),
        "{text}"
    );
    assert!(
        lines[2].starts_with("paper-b,1,1,24,1,dxkv,run,24,read,6000,0,0,"),
        "{text}"
    );
    assert_eq!(v["workload"]["fieldlength"], 32);
    check(v, "load", 3000, &["insert"]);
    check(v, "run", 6000, &["read"]);
}

#[test]
fn local_cluster_of_two_storage_nodes_runs_workload_f_and_a_set_property() {
    let all = run_local(
        "f",
        2,
        &[
            "--set",
            "requestdistribution=hotspot",
            "--set",
            "fieldcount=3",
        ],
    );
    let v = &runs(&all)[0];
    assert_eq!(v["workload"]["requestdistribution"], "hotspot");
    assert_eq!(v["workload"]["fieldcount"], 3);
    check(v, "load", 3000, &["insert"]);
    check(v, "run", 6000, &["read", "read-modify-write"]);
}

/// Three benchmark processes over two storage processes, started together
/// phase by phase: each loads its slice, inserts keys of its own during
/// the run (workload D, reads of the latest inserts), and every read finds
/// its record; the merged reports count every node's operations.
#[test]
fn three_benchmark_nodes_share_the_load_and_insert_disjoint_keys() {
    let all = run_local("d", 2, &["--benchmark-nodes", "3", "--threads", "8"]);
    let v = &runs(&all)[0];
    assert_eq!(v["benchmark_nodes"], 3);
    check(v, "load", 3000, &["insert"]);
    check(v, "run", 3 * 6000, &["read", "insert"]);
    let run = &v["reports"][1];
    assert_eq!(run["threads"], 24);
    assert!(run["ops"]["insert"]["ok"].as_u64().unwrap() > 0);
    for phase in v["per_node_ops_per_sec"].as_array().unwrap() {
        assert_eq!(phase.as_array().unwrap().len(), 3, "{v}");
    }
}

/// In `dir`: an executable launcher script and a node file of three
/// "hosts", each a port of 127.0.0.1 (ids out of order, with a comment).
fn three_hosts(
    dir: &std::path::Path,
    launcher_script: &str,
) -> (std::path::PathBuf, std::path::PathBuf) {
    use std::os::unix::fs::PermissionsExt;
    let launcher = dir.join("launcher");
    std::fs::write(&launcher, launcher_script).unwrap();
    std::fs::set_permissions(&launcher, std::fs::Permissions::from_mode(0o755)).unwrap();
    let port = free_ports(3);
    let nodes = dir.join("nodes");
    std::fs::write(
        &nodes,
        format!(
            "# id host\n0 127.0.0.1:{port}\n2 127.0.0.1:{}\n1 127.0.0.1:{}\n",
            port + 2,
            port + 1
        ),
    )
    .unwrap();
    (launcher, nodes)
}

/// `--hosts`: every node started through a launcher on the host of its id
/// in a node file, its command line quoted for the host's shell and its
/// configuration sent on stdin. The launcher here runs the line through
/// `sh -c` on this machine, as ssh runs it on the host; the node file gives
/// each node its own port of 127.0.0.1.
#[test]
fn nodes_start_through_a_launcher_on_the_hosts_of_a_node_file() {
    let dir = std::env::temp_dir().join(format!("dxkv-hosts-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (launcher, nodes) = three_hosts(&dir, "#!/bin/sh\nshift\nexec sh -c \"$*\"\n");
    let all = run_local(
        "paper-b",
        1,
        &[
            "--benchmark-nodes",
            "2",
            "--threads",
            "12",
            "--hosts",
            nodes.to_str().unwrap(),
            "--launcher",
            launcher.to_str().unwrap(),
            // A space and quotes the host's shell must pass through.
            "--set",
            "fieldlengthdistribution= \"uniform\"",
        ],
    );
    let v = &runs(&all)[0];
    assert_eq!(v["workload"]["fieldlengthdistribution"], "uniform");
    check(v, "load", 3000, &["insert"]);
    check(v, "run", 2 * 6000, &["read"]);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A benchmark node killed right after its load report: the run fails
/// naming it, well within the test's deadline, instead of waiting for it
/// to be ready for the run phase.
#[test]
fn a_benchmark_node_lost_between_phases_fails_the_run() {
    let dir = std::env::temp_dir().join(format!("dxkv-lost-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // Node 1 is killed right after its load report; the others run as
    // through ssh.
    let script = r#"#!/bin/sh
shift
case "$*" in
*'--client-index 1 '*)
  pidfile=$(mktemp)
  sh -c "echo \$\$ > $pidfile; exec $*" | while read -r l; do
    echo "$l"
    case $l in REPORT*) kill -9 "$(cat "$pidfile")"; rm -f "$pidfile"; exit 0;; esac
  done ;;
*) exec sh -c "$*" ;;
esac
"#;
    let (launcher, nodes) = three_hosts(&dir, script);
    let mut child = Command::new(env!("CARGO_BIN_EXE_dxkv"))
        .args(["local", "--workload", "paper-b", "--threads", "4"])
        .args(["--records", "500", "--operations", "500"])
        .args(["--benchmark-nodes", "2", "--hosts"])
        .arg(&nodes)
        .arg("--launcher")
        .arg(&launcher)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            panic!("dxkv local still waits for a benchmark node that is gone");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    assert!(!status.success());
    assert!(err.contains("benchmark node 1 exited early"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A list of thread counts runs each on a fresh cluster, and the plots put
/// them on the x axis.
#[test]
fn thread_counts_run_in_turn_and_are_plotted() {
    let plots = std::env::temp_dir().join(format!("dxkv-tplots-{}", std::process::id()));
    let all = run_local(
        "paper-b",
        1,
        &["--threads", "4,24", "--plot", plots.to_str().unwrap()],
    );
    let r = runs(&all);
    assert_eq!(r.len(), 2);
    for (run, t) in r.iter().zip([4, 24]) {
        assert_eq!(run["threads_per_node"], t);
        assert_eq!(run["reports"][1]["threads"], t);
        check(run, "run", 6000, &["read"]);
    }
    for f in ["dxkv_paper-b_throughput.svg", "dxkv_paper-b_latency.png"] {
        assert!(
            std::fs::metadata(plots.join(f)).unwrap().len() > 1000,
            "{f}"
        );
    }
    std::fs::remove_dir_all(&plots).unwrap();
}

/// Root with iproute2, else a skip (outside CI).
fn can_netns() -> bool {
    let ok = Command::new("ip")
        .args(["netns", "list"])
        .output()
        .is_ok_and(|o| o.status.success())
        && std::fs::read_to_string("/proc/self/status").is_ok_and(|s| {
            s.lines()
                .any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(1) == Some("0"))
        });
    if !ok {
        assert!(
            std::env::var("CI").is_err(),
            "CI runs as root with iproute2"
        );
        println!("skipped: network namespaces need root and iproute2");
    }
    ok
}

/// Clusters of 2 and 4 nodes, each node in its own network namespace
/// (half storage, half benchmark): both sizes run, a summary row each, and
/// the scaling plots are drawn.
#[test]
fn clusters_of_two_and_four_nodes_run_in_network_namespaces_and_plot() {
    if !can_netns() {
        return;
    }
    let plots = std::env::temp_dir().join(format!("dxkv-plots-{}", std::process::id()));
    let all = run_local(
        "paper-b",
        1,
        &[
            "--nodes",
            "2,4",
            "--netns",
            "--threads",
            "12",
            "--plot",
            plots.to_str().unwrap(),
        ],
    );
    let r = runs(&all);
    assert_eq!(r.len(), 2);
    for (run, n) in r.iter().zip([1, 2]) {
        assert_eq!(run["storage_nodes"], n);
        assert_eq!(run["benchmark_nodes"], n);
        check(run, "load", 3000, &["insert"]);
        check(run, "run", n * 6000, &["read"]);
    }
    for f in ["dxkv_paper-b_throughput", "dxkv_paper-b_latency"] {
        for ext in ["svg", "png"] {
            let p = plots.join(format!("{f}.{ext}"));
            assert!(std::fs::metadata(&p).unwrap().len() > 1000, "{p:?}");
        }
    }
    std::fs::remove_dir_all(&plots).unwrap();
}

#[test]
fn bad_arguments_are_reported() {
    let out = Command::new(env!("CARGO_BIN_EXE_dxkv"))
        .args(["local", "--workload", "nope"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown workload"));
}

/// True if `cmd` runs; outside CI a missing baseline skips the test (CI
/// installs memcached and redis-server).
fn installed(cmd: &str) -> bool {
    let ok = Command::new(cmd).arg("--version").output().is_ok();
    if !ok {
        assert!(std::env::var("CI").is_err(), "{cmd} missing in CI");
        println!("skipped: {cmd} not installed (apt-get install memcached redis-server)");
    }
    ok
}

#[test]
fn memcached_and_redis_baselines_run_through_the_same_driver() {
    if !installed("memcached") || !installed("redis-server") {
        return;
    }
    let v = run_local("paper-a", 1, &["--bindings", "dxkv,memcached,redis"]);
    let reports: Vec<&serde_json::Value> = runs(&v)
        .iter()
        .flat_map(|r| r["reports"].as_array().unwrap())
        .collect();
    for b in ["dxkv", "memcached", "redis"] {
        let mine: Vec<&&serde_json::Value> = reports.iter().filter(|r| r["binding"] == b).collect();
        assert_eq!(mine.len(), 2, "{b}: a load and a run report");
        for r in mine {
            for (_, s) in r["ops"].as_object().unwrap() {
                assert_eq!(s["errors"], 0, "{b}: {r}");
                assert_eq!(s["not_found"], 0, "{b}: {r}");
            }
        }
    }
}

/// Two `dxkv storage` processes and a client in this process: killing one
/// (SIGKILL) fails only its keys, within the client's timeout; restarted
/// with the same id it serves its keys again, empty.
#[test]
fn a_killed_storage_process_fails_only_its_keys_and_restarts_empty() {
    use dxkv::{Client, Record};
    use dxnet::{Config, Node, NodeId};
    use std::io::BufRead;
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    let port = free_ports(3);
    let dir = std::env::temp_dir().join(format!("dxkv-kill-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let start = |id: u16| {
        let path = dir.join(format!("node{id}.json"));
        let cfg = Config::tcp_localhost(id, 3, port);
        std::fs::write(&path, serde_json::to_string(&cfg).unwrap()).unwrap();
        let mut child = Command::new(env!("CARGO_BIN_EXE_dxkv"))
            .args(["storage", "--stop-on-stdin-eof", "--config"])
            .arg(&path)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert!(line.starts_with("READY"), "{line}");
        child
    };
    let mut storage = vec![start(0), start(1)];
    let node = Arc::new(Node::start(Config::tcp_localhost(2, 3, port)).unwrap());
    let kv = Client::new(node, vec![NodeId(0), NodeId(1)])
        .unwrap()
        .with_timeout(Duration::from_secs(2));
    let keys: Vec<Vec<u8>> = (0..200).map(|i| format!("k{i}").into_bytes()).collect();
    for k in &keys {
        kv.put(k, &Record::value(k)).unwrap();
    }
    let (on1, on0): (Vec<_>, Vec<_>) = keys.iter().partition(|k| kv.node_of_key(k) == NodeId(1));

    storage[1].kill().unwrap();
    storage[1].wait().unwrap();
    for k in on1.iter().take(20) {
        let t = Instant::now();
        let e = kv.get(k).unwrap_err();
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "failed only after {:?}",
            t.elapsed()
        );
        assert!(
            matches!(
                &e,
                dxkv::Error::Net(dxnet::Error::Unreachable(..) | dxnet::Error::Timeout(_))
            ),
            "{e}"
        );
    }
    for k in &on0 {
        assert_eq!(kv.get(k).unwrap().unwrap().record, Record::value(k));
    }

    storage[1] = start(1);
    let t = Instant::now();
    while kv.get(on1[0]).is_err() {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "restarted node never served"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    for k in &on1 {
        assert_eq!(
            kv.get(k).unwrap(),
            None,
            "a restarted storage node is empty"
        );
    }
    kv.put(on1[0], &Record::value(b"again")).unwrap();
    assert_eq!(
        kv.get(on1[0]).unwrap().unwrap().record,
        Record::value(b"again")
    );
    for mut c in storage {
        drop(c.stdin.take());
        let _ = c.wait();
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `dxkv storage` with its standard input closed keeps serving; SIGTERM
/// under load (memcached clients and dxkv clients writing and reading)
/// shuts it down in order: every answer a client gets is right, the rest
/// are clean errors (end of stream, refused, node gone), nothing waits for
/// its timeout, and the process exits 0.
#[test]
fn sigterm_under_load_shuts_storage_down_in_order() {
    use dxkv::{Client, Record};
    use dxnet::{Config, Node, NodeId};
    use std::io::{BufRead, BufReader, Read, Write};
    use std::net::TcpStream;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    let port = free_ports(3);
    let mc_port = port + 2;
    let dir = std::env::temp_dir().join(format!("dxkv-term-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("node0.json");
    std::fs::write(
        &path,
        serde_json::to_string(&Config::tcp_localhost(0, 2, port)).unwrap(),
    )
    .unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_dxkv"))
        .args([
            "storage",
            "--memcached-port",
            &mc_port.to_string(),
            "--config",
        ])
        .arg(&path)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert!(line.starts_with("READY"), "{line}");

    let node = Arc::new(Node::start(Config::tcp_localhost(1, 2, port)).unwrap());
    let kv = Client::new(node, vec![NodeId(0)])
        .unwrap()
        .with_timeout(Duration::from_secs(20));
    let answered = Arc::new(AtomicU64::new(0));
    // Memcached clients: set then get their own keys, every reply checked.
    let mc: Vec<_> = (0..4)
        .map(|t| {
            let answered = answered.clone();
            std::thread::spawn(move || -> String {
                let mut conn = TcpStream::connect(("127.0.0.1", mc_port)).unwrap();
                conn.set_read_timeout(Some(Duration::from_secs(20)))
                    .unwrap();
                let mut r = BufReader::new(conn.try_clone().unwrap());
                for i in 0u64.. {
                    let (k, v) = (format!("mc{t}-{i}"), format!("value {t} {i}"));
                    let cmd = format!("set {k} 0 0 {}\r\n{v}\r\nget {k}\r\n", v.len());
                    if let Err(e) = conn.write_all(cmd.as_bytes()) {
                        return format!("write: {:?}", e.kind());
                    }
                    let mut got = String::new();
                    while !got.ends_with("END\r\n") {
                        match r.read_line(&mut got) {
                            Ok(0) => {
                                // The stream ends only between commands.
                                assert!(got.is_empty(), "cut mid-reply: {got:?}");
                                return "end of stream".into();
                            }
                            Ok(_) => {}
                            Err(e) => {
                                assert_ne!(e.kind(), std::io::ErrorKind::WouldBlock, "hung");
                                return format!("read: {:?}", e.kind());
                            }
                        }
                    }
                    let want = format!("STORED\r\nVALUE {k} 0 {}\r\n{v}\r\nEND\r\n", v.len());
                    assert_eq!(got, want);
                    answered.fetch_add(1, Ordering::Relaxed);
                }
                unreachable!()
            })
        })
        .collect();
    // dxkv clients over dxnet.
    let kv = Arc::new(kv);
    let dx: Vec<_> = (0..4)
        .map(|t| {
            let (kv, answered) = (kv.clone(), answered.clone());
            std::thread::spawn(move || -> String {
                for i in 0u64.. {
                    let k = format!("dx{t}-{i}").into_bytes();
                    let r = kv
                        .put(&k, &Record::value(&k))
                        .and_then(|_| kv.get(&k))
                        .map(|got| assert_eq!(got.unwrap().record, Record::value(&k)));
                    match r {
                        Ok(()) => answered.fetch_add(1, Ordering::Relaxed),
                        Err(dxkv::Error::Net(dxnet::Error::Timeout(_))) => panic!("hung"),
                        Err(e) => return e.to_string(),
                    };
                }
                unreachable!()
            })
        })
        .collect();
    let t = Instant::now();
    while answered.load(Ordering::Relaxed) < 400 {
        assert!(t.elapsed() < Duration::from_secs(60), "no progress");
        std::thread::sleep(Duration::from_millis(5));
    }
    let pid = child.id().to_string();
    assert!(Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());
    for h in mc.into_iter().chain(dx) {
        let why = h.join().unwrap();
        println!("client stopped: {why}");
    }
    let t = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "storage did not exit"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert!(status.success(), "{status}: {err}");
    assert!(
        err.contains("SIGTERM: shutting down") && err.contains("dxkv: stopped"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
