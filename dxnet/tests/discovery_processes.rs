//! Discovery with nodes as processes in separate network namespaces (as
//! separate hosts on one bridge): while a stream runs from node 1 to node
//! 0, nodes 2 and 3 join (discovered, answered both ways) and leave (one
//! exits, one is killed), come back, and node 3 is removed at the hub.
//! The stream runs until every join and leave is done; every message of it
//! arrives once and in order; requests to a
//! node that left fail with a typed `Unreachable`, to a removed node with
//! `Unreachable::Removed`. Skipped (with the reason) without root or `ip`.
//!
//! The test binary re-runs itself as the nodes (`child_*` tests).

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::netns::Star;
use common::proc::*;
use common::*;
use dxnet::config::NodeEntry;
use dxnet::{Config, DiscoveryConfig, Error, Node, NodeId, Unreachable};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, Debug)]
struct Who(u32);
#[derive(Serialize, Deserialize, Debug)]
struct Me(u16);
dxnet::request!(Who, 47, 1 => Me);
dxnet::message!(Me, 47, 2);

const PORT: u16 = 7700;
const NODES: usize = 4;
const THREADS: u16 = 4;

/// The full node map (addresses in the namespaces), discovery every 50 ms.
fn config(id: u16) -> Config {
    let ips: Vec<String> = env("IPS").split(',').map(str::to_owned).collect();
    let mut c = Config::tcp_localhost(id, 0, 0);
    c.nodes = ips
        .iter()
        .enumerate()
        .map(|(i, ip)| NodeEntry::new(i as u16, format!("{ip}:{PORT}")))
        .collect();
    c.cluster_secret = Some("discovery-processes".into());
    c.discovery = Some(DiscoveryConfig::new(Vec::new(), 50));
    c.limits.connect_timeout_ms = 2000;
    c.park.spin_us = 20;
    c.park.yield_us = 200;
    c
}

fn start(id: u16) -> Node {
    init_child_log();
    let node = Node::start(config(id)).unwrap();
    node.register_request(move |_, Who(_)| Me(id)).unwrap();
    node
}

/// Node 0: receives the stream; asks and removes nodes on command.
#[test]
fn child_hub() {
    if !is_child() {
        return;
    }
    let node = start(0);
    let log = register_step_log(&node);
    println!("READY");
    loop {
        let cmd = read_command("");
        let mut w = cmd.split_whitespace();
        let word = w.next();
        let arg = || -> u16 { cmd.split_whitespace().nth(1).unwrap().parse().unwrap() };
        match (
            word,
            word.filter(|c| *c != "check" && *c != "exit")
                .map(|_| arg()),
        ) {
            (Some("ask"), Some(n)) => {
                match node.request(NodeId(n), &Who(1), Duration::from_secs(5)) {
                    Ok(Me(id)) => println!("ASKED {n} ok={id}"),
                    Err(Error::Unreachable(_, Unreachable::Removed)) => {
                        println!("ASKED {n} err=removed")
                    }
                    Err(Error::Unreachable(_, cause)) => {
                        println!("ASKED {n} err=unreachable ({cause})")
                    }
                    Err(e) => println!("ASKED {n} err=other ({e})"),
                }
            }
            (Some("wait"), Some(n)) => {
                common::wait_for(30, "discovered", || node.nodes().contains(&NodeId(n)));
                println!("FOUND {n}");
            }
            (Some("gone"), Some(n)) => {
                common::wait_for(30, "undiscovered", || !node.nodes().contains(&NodeId(n)));
                println!("GONE {n}");
            }
            (Some("remove"), Some(n)) => {
                node.remove_node(NodeId(n)).unwrap();
                println!("REMOVED {n}");
            }
            (Some("check"), _) => {
                // check N0,N1,..: the steps each streamer thread sent.
                let sent: Vec<u64> = cmd
                    .split_whitespace()
                    .nth(1)
                    .unwrap()
                    .split(',')
                    .map(|x| x.parse().unwrap())
                    .collect();
                for (t, &n) in sent.iter().enumerate() {
                    let t = t as u16;
                    wait_for(120, "the whole stream", || log.received(1, t) >= n);
                    log.assert_thread_in_order(1, t, n);
                }
                println!("STREAM ok");
            }
            (Some("exit"), _) => break,
            other => panic!("hub: unknown command {other:?}"),
        }
    }
}

/// Node 1: streams numbered steps (random sizes) to node 0 from several
/// threads until told to stop; prints how many each thread sent.
#[test]
fn child_streamer() {
    if !is_child() {
        return;
    }
    let node = Arc::new(start(1));
    common::wait_for(60, "node 0 discovered", || {
        node.nodes().contains(&NodeId(0))
    });
    let stop = Arc::new(AtomicBool::new(false));
    let ts: Vec<_> = (0..THREADS)
        .map(|t| {
            let (node, stop) = (node.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut seq = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let pad = vec![t as u8; size_for(seq * 7 + u64::from(t), 2000)];
                    node.send(NodeId(0), &Step(t, seq, pad)).unwrap();
                    seq += 1;
                }
                seq
            })
        })
        .collect();
    println!("READY");
    read_command("stop");
    stop.store(true, Ordering::Relaxed);
    let sent: Vec<String> = ts
        .into_iter()
        .map(|t| t.join().unwrap().to_string())
        .collect();
    println!("SENT {}", sent.join(","));
    read_command("exit");
}

/// Nodes 2 and 3: join, answer, ask the hub, leave on command.
#[test]
fn child_joiner() {
    if !is_child() {
        return;
    }
    let id: u16 = env_parse("NODE");
    let node = start(id);
    common::wait_for(60, "node 0 discovered", || {
        node.nodes().contains(&NodeId(0))
    });
    let r = node.request(NodeId(0), &Who(2), Duration::from_secs(10));
    println!("READY hub={:?}", r.map(|m| m.0));
    read_command("exit");
}

#[test]
fn processes_join_and_leave_in_namespaces_while_a_stream_runs() {
    if is_child() {
        return;
    }
    let star = match Star::create("dxd", NODES) {
        Ok(s) => s,
        Err(e) => {
            println!("skipped: cannot create network namespaces: {e}");
            return;
        }
    };
    let ips = (0..NODES).map(|i| star.ip(i)).collect::<Vec<_>>().join(",");
    let spawn = |i: usize, test: &str| {
        ChildProc::spawn_in(
            Some(&star.namespace(i)),
            test,
            &[("IPS", ips.clone()), ("NODE", i.to_string())],
        )
    };
    let mut hub = spawn(0, "child_hub");
    hub.wait_line("READY", 60);
    let mut streamer = spawn(1, "child_streamer");
    streamer.wait_line("READY", 60);
    let ask = |hub: &mut ChildProc, n: u16| {
        let m = hub.mark();
        hub.command(&format!("ask {n}"));
        hub.wait_line_since(m, &format!("ASKED {n} "), 60)
    };
    for round in 0..2 {
        let mut joiners: Vec<ChildProc> = (2..4).map(|i| spawn(i, "child_joiner")).collect();
        for j in &mut joiners {
            let l = j.wait_line("READY", 60);
            assert_eq!(l, "READY hub=Ok(0)", "round {round}");
        }
        for n in 2..4u16 {
            let m = hub.mark();
            hub.command(&format!("wait {n}"));
            hub.wait_line_since(m, &format!("FOUND {n}"), 60);
            assert_eq!(ask(&mut hub, n), format!("ASKED {n} ok={n}"));
        }
        // Node 2 leaves in order, node 3 is killed.
        let mut it = joiners.into_iter();
        let mut j2 = it.next().unwrap();
        let mut j3 = it.next().unwrap();
        j2.command("exit");
        wait_child(j2, 30);
        j3.kill9();
        for n in 2..4u16 {
            let m = hub.mark();
            hub.command(&format!("gone {n}"));
            hub.wait_line_since(m, &format!("GONE {n}"), 60);
            let l = ask(&mut hub, n);
            assert!(l.starts_with(&format!("ASKED {n} err=unreachable")), "{l}");
        }
    }
    // Node 3 removed at the hub: back again, it is refused as removed.
    let m = hub.mark();
    hub.command("remove 3");
    hub.wait_line_since(m, "REMOVED 3", 30);
    let mut j2 = spawn(2, "child_joiner");
    let mut j3 = spawn(3, "child_joiner");
    assert_eq!(j2.wait_line("READY", 60), "READY hub=Ok(0)");
    let m = hub.mark();
    hub.command("wait 2");
    hub.wait_line_since(m, "FOUND 2", 60);
    assert_eq!(ask(&mut hub, 2), "ASKED 2 ok=2");
    assert_eq!(ask(&mut hub, 3), "ASKED 3 err=removed");
    // Node 3 never discovers the hub (its probes are ignored): it gives up.
    j3.kill9();
    j2.command("exit");
    wait_child(j2, 30);

    streamer.command("stop");
    let sent = streamer.wait_line("SENT ", 120);
    let counts = sent.trim_start_matches("SENT ");
    println!("steps per streamer thread: {counts}");
    assert!(
        counts.split(',').all(|c| c.parse::<u64>().unwrap() > 0),
        "{sent}"
    );
    let m = hub.mark();
    hub.command(&format!("check {counts}"));
    hub.wait_line_since(m, "STREAM ok", 180);
    streamer.command("exit");
    hub.command("exit");
    wait_child(streamer, 30);
    wait_child(hub, 30);
}
