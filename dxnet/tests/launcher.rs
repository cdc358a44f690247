//! Clusters formed from launcher variables alone: Open MPI's `mpirun` and
//! MPICH's `mpiexec` start this test binary's `cluster_member` as ranks,
//! each of which takes its node id and the node map from
//! `Config::from_env` (rank variables, `DXNET_NODES`, `DXNET_PORT`),
//! requests an answer from every other rank and waits until every other
//! rank has reached it. (Slurm and Kubernetes variables are set by hand
//! in `src/launch/tests.rs`.)

use std::collections::HashSet;
use std::process::{Command, Stdio};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use dxnet::{Config, Node, NodeId};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize)]
struct Ping(u64);
#[derive(Serialize, Deserialize)]
struct Pong(u64, u16);
#[derive(Serialize, Deserialize)]
struct Reached;
dxnet::message!(Pong, 90, 2);
dxnet::request!(Ping, 90, 1 => Pong);
dxnet::message!(Reached, 90, 3);

/// How long a member waits for the others to start and finish.
const PATIENCE: Duration = Duration::from_secs(90);

/// One rank of a launched cluster (run only by the tests below, through a
/// launcher).
#[test]
#[ignore = "a rank of the clusters the launcher tests start"]
fn cluster_member() {
    let cfg = Config::from_env().expect("configuration from the launcher");
    let me = cfg.own_id();
    let size = cfg.nodes.len();
    let peers: Vec<NodeId> = cfg
        .nodes
        .iter()
        .map(|n| NodeId(n.id))
        .filter(|&n| n != me)
        .collect();
    let node = Node::start(cfg).expect("node start");
    let reached_me = Arc::new((Mutex::new(HashSet::new()), Condvar::new()));
    let r = reached_me.clone();
    // Registered before the request handler: a peer that got an answer
    // from this node can count on its `Reached` being received.
    node.register(move |src: NodeId, _: Reached| {
        r.0.lock().unwrap().insert(src);
        r.1.notify_all();
    })
    .unwrap();
    node.register_request(move |_, Ping(x)| Pong(x + 1, me.0))
        .unwrap();
    let deadline = Instant::now() + PATIENCE;
    for &p in &peers {
        loop {
            match node.request(p, &Ping(u64::from(me.0)), Duration::from_secs(2)) {
                Ok(Pong(x, from)) => {
                    assert_eq!((x, from), (u64::from(me.0) + 1, p.0), "answer from {p}");
                    break;
                }
                // The peer may not listen yet.
                Err(e) => {
                    assert!(Instant::now() < deadline, "{me}: {p} never answered: {e}");
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        }
        node.send(p, &Reached).unwrap();
    }
    let (set, cv) = &*reached_me;
    let mut got = set.lock().unwrap();
    while got.len() < peers.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(!left.is_zero(), "{me}: reached by {got:?} only");
        got = cv.wait_timeout(got, left).unwrap().0;
    }
    println!("CLUSTER-MEMBER {} of {size}", me.0);
}

fn on_path(cmd: &str) -> bool {
    Command::new(cmd)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok()
}

/// Four free ports in a row below the ephemeral range.
fn free_ports(n: u16, salt: u16) -> u16 {
    let mut p = 21_000 + (std::process::id() % 400) as u16 * 10 + salt * 5;
    loop {
        if (0..n).all(|i| std::net::TcpListener::bind(("127.0.0.1", p + i)).is_ok()) {
            return p;
        }
        p += n;
    }
}

/// Runs `launcher` with `ranks` copies of `cluster_member` and checks that
/// each reported a cluster of `ranks` with its own id.
fn launch(mut launcher: Command, ranks: usize, salt: u16) {
    let port = free_ports(ranks as u16, salt);
    let out = launcher
        .arg(std::env::current_exe().unwrap())
        .args(["cluster_member", "--exact", "--ignored", "--nocapture"])
        .args(["--test-threads", "1"])
        .env("DXNET_NODES", "127.0.0.1")
        .env("DXNET_PORT", port.to_string())
        .env_remove("DXNET_CONFIG")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{}\n{stdout}\n{stderr}", out.status);
    let mut ids: Vec<usize> = stdout
        .lines()
        // The ranks' outputs interleave: a report may follow another
        // rank's text on its line.
        .filter_map(|l| l.find("CLUSTER-MEMBER ").map(|i| &l[i + 15..]))
        .map(|l| {
            let (id, size) = l.split_once(" of ").unwrap();
            assert_eq!(size.trim().parse::<usize>().unwrap(), ranks, "{l}");
            id.parse().unwrap()
        })
        .collect();
    ids.sort_unstable();
    assert_eq!(ids, (0..ranks).collect::<Vec<_>>(), "{stdout}\n{stderr}");
}

#[test]
fn open_mpi_mpirun_forms_one_cluster() {
    let cmd = if on_path("mpirun.openmpi") {
        "mpirun.openmpi"
    } else {
        "mpirun"
    };
    if !on_path(cmd) {
        assert!(std::env::var("CI").is_err(), "Open MPI missing in CI");
        println!("skipped: Open MPI not installed (apt-get install openmpi-bin)");
        return;
    }
    let mut c = Command::new(cmd);
    c.env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .args(["--oversubscribe", "-np", "4"]);
    launch(c, 4, 0);
}

#[test]
fn mpich_mpiexec_forms_one_cluster() {
    if !on_path("mpiexec.mpich") {
        assert!(std::env::var("CI").is_err(), "MPICH missing in CI");
        println!("skipped: MPICH not installed (apt-get install mpich)");
        return;
    }
    let mut c = Command::new("mpiexec.mpich");
    c.args(["-n", "3"]);
    launch(c, 3, 1);
}
