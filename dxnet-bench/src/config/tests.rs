use super::*;

#[test]
fn sizes_expand_powers_of_two() {
    let s = Sizes::default().expand();
    assert_eq!(s.len(), 21);
    assert_eq!(s[0], 1);
    assert_eq!(*s.last().unwrap(), 1 << 20);
    assert_eq!(
        Sizes::Range { min: 3, max: 40 }.expand(),
        vec![4, 8, 16, 32]
    );
    assert_eq!(Sizes::List(vec![64, 8, 64]).expand(), vec![8, 64]);
}

#[test]
fn count_halves_from_4k() {
    assert_eq!(scaled_count(1000, 1, 4096, 16), 1000);
    assert_eq!(scaled_count(1000, 4096, 4096, 16), 1000);
    assert_eq!(scaled_count(1000, 8192, 4096, 16), 500);
    assert_eq!(scaled_count(1000, 16384, 4096, 16), 250);
    assert_eq!(scaled_count(1000, 1 << 20, 4096, 16), 16);
    assert_eq!(scaled_count(8, 1 << 20, 4096, 16), 8);
    assert_eq!(scaled_count(1000, 5000, 4096, 1), 500);
}

#[test]
fn parses_json_with_defaults() {
    let c = BenchConfig::from_json(
        r#"{"bindings":["raw-tcp"],
            "benchmarks":[{"operation":"throughput","modes":["uni","bi"],"sizes":[64,4096],"count":1000},
                          {"operation":"all_to_all","sizes":{"min":1,"max":4},"count":10,"nodes":[3]}],
            "params":{"base_port":30000,"dxnet":{"limits":{"orb_size":4194304}}}}"#,
    )
    .unwrap();
    assert_eq!(c.benchmarks[0].repetitions, 3);
    assert_eq!(c.benchmarks[0].threads, vec![1]);
    assert_eq!(c.benchmarks[1].sizes.expand(), vec![1, 2, 4]);
    assert_eq!(c.params.base_port, 30000);
    assert_eq!(c.params.min_count, Params::default().min_count);
    assert_eq!(c.params.dxnet["limits"]["orb_size"], 4194304);
    let groups = c.plan().unwrap();
    // throughput n=2 and all-to-all n=3 need different processes.
    assert_eq!(groups.len(), 2);
    assert_eq!(groups[0].key.handlers, 0, "raw bindings ignore handlers");
    assert_eq!(groups[0].runs.len(), 4);
    assert_eq!(groups[0].runs[0].warmup, 100);
    assert_eq!(groups[1].runs.len(), 3);
}

#[test]
fn parses_toml() {
    let c = BenchConfig::from_toml(
        r#"
bindings = ["raw-tcp"]
[[benchmarks]]
operation = "pingpong"
sizes = [1, 2]
count = 50
warmup = 5
threads = [1, 2]
[params]
timeout_s = 5
"#,
    )
    .unwrap();
    let g = c.plan().unwrap();
    assert_eq!(g.len(), 2);
    assert_eq!(g[1].key.threads, 2);
    assert_eq!(g[0].runs[0].warmup, 5);
    assert_eq!(g[0].runs[0].mode, Mode::Uni);
}

#[test]
fn perftest_runs_only_its_own_tests() {
    let c = BenchConfig::from_json(
        r#"{"bindings":["dxnet-ib","raw-verbs","ib_send_bw","ib_send_lat"],
            "benchmarks":[{"operation":"throughput","modes":["uni","bi"],"sizes":[64,65536],"count":1000},
                          {"operation":"pingpong","sizes":[64],"count":100,"threads":[1,2]}],
            "params":{"rdma":{"device":"rxe0","gid_index":1},"raw_verbs":{"rx_depth":64}}}"#,
    )
    .unwrap();
    assert_eq!(c.params.raw_verbs.rx_depth, 64);
    assert_eq!(c.params.raw_verbs.tx_depth, 128);
    let g = c.plan().unwrap();
    let find = |b: &str, t: usize| g.iter().find(|g| g.key.binding == b && g.key.threads == t);
    assert_eq!(find("dxnet-ib", 1).unwrap().runs.len(), 5);
    assert_eq!(find("dxnet-ib", 1).unwrap().key.handlers, 2);
    assert_eq!(find("raw-verbs", 2).unwrap().runs.len(), 1);
    let bw = find("ib_send_bw", 1).unwrap();
    assert_eq!(bw.runs.len(), 4, "throughput only, uni and bi (-b)");
    assert!(bw.runs.iter().all(|r| r.operation == Operation::Throughput));
    let lat = find("ib_send_lat", 1).unwrap();
    assert_eq!(lat.runs.len(), 1);
    assert_eq!(lat.runs[0].operation, Operation::Pingpong);
    assert!(find("ib_send_lat", 2).is_none(), "one thread only");
    assert!(BenchConfig::from_json(
        r#"{"bindings":["raw-verbs"],"benchmarks":[],"params":{"raw_verbs":{"recv_size":0}}}"#
    )
    .is_err());
    let env = |k: &str| match k {
        "RDMA_DEV" => Some("mlx5_0".to_string()),
        "RDMA_GID_INDEX" => Some("3".to_string()),
        _ => None,
    };
    let t = RdmaParams::default().resolve_with(env);
    assert_eq!(
        (t.device.as_deref(), t.port, t.gid_index),
        (Some("mlx5_0"), 1, Some(3))
    );
    let t = c.params.rdma.resolve_with(env);
    assert_eq!((t.device.as_deref(), t.gid_index), (Some("rxe0"), Some(1)));
}

#[test]
fn rejects_bad_configs() {
    let bad = [
        r#"{"bindings":[],"benchmarks":[]}"#,
        r#"{"bindings":["nope"],"benchmarks":[]}"#,
        r#"{"bindings":["raw-tcp"],"benchmarks":[{"operation":"throughput","count":0}]}"#,
        r#"{"bindings":["raw-tcp"],"benchmarks":[{"operation":"throughput","count":1,"nodes":[3]}]}"#,
        r#"{"bindings":["raw-tcp"],"benchmarks":[{"operation":"throughput","count":1,"threads":[0]}]}"#,
        r#"{"bindings":["raw-tcp"],"benchmarks":[{"operation":"throughput","count":1,"bogus":1}]}"#,
        r#"{"bindings":["raw-tcp"],"benchmarks":[{"operation":"flood","count":1}]}"#,
    ];
    for b in bad {
        assert!(BenchConfig::from_json(b).is_err(), "accepted {b}");
    }
}

#[test]
fn size_parsing_and_formatting() {
    assert_eq!(parse_size("64").unwrap(), 64);
    assert_eq!(parse_size("4k").unwrap(), 4096);
    assert_eq!(parse_size("4KiB").unwrap(), 4096);
    assert_eq!(parse_size("1M").unwrap(), 1 << 20);
    assert_eq!(parse_size("16B").unwrap(), 16);
    assert!(parse_size("x").is_err());
    assert_eq!(fmt_size(64), "64 B");
    assert_eq!(fmt_size(4096), "4 KiB");
    assert_eq!(fmt_size(1 << 20), "1 MiB");
    assert_eq!(fmt_size(1000), "1000 B");
}

#[test]
fn default_json_is_the_builtin_suite() {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/default.json");
    assert_eq!(
        BenchConfig::from_file(&p).unwrap(),
        BenchConfig::default_suite()
    );
}

#[test]
fn default_suite_is_valid() {
    let c = BenchConfig::default_suite();
    c.validate().unwrap();
    let groups = c.plan().unwrap();
    let runs = |b: &str, t: usize| {
        groups
            .iter()
            .find(|g| g.key.binding == b && g.key.threads == t)
            .map(|g| g.runs.clone())
            .unwrap_or_default()
    };
    for b in ["raw-tcp", "raw-tcp-batched", "dxnet-tcp", "dxnet-tcp-typed"] {
        // 1 thread: throughput at 3 sizes and a round trip; 16 threads:
        // 64 B throughput and a round trip.
        assert_eq!(runs(b, 1).len(), 4, "{b}");
        let r16 = runs(b, 16);
        assert_eq!(r16.len(), 2, "{b}");
        assert!(r16.iter().all(|r| r.size == 64));
        assert!(r16.iter().any(|r| r.operation == Operation::Throughput));
        assert!(r16.iter().any(|r| r.operation == Operation::Pingpong));
    }
    // --threads 16 on every entry: 64 B throughput once, at the first
    // entry's count.
    let mut c = c;
    for e in &mut c.benchmarks {
        e.threads = vec![16];
    }
    let g = c.plan().unwrap();
    assert_eq!(g.len(), 4);
    let tp64: Vec<_> = g[0]
        .runs
        .iter()
        .filter(|r| r.operation == Operation::Throughput && r.size == 64)
        .collect();
    assert_eq!(tp64.len(), 1);
    assert_eq!(tp64[0].count, 200_000);
}

#[test]
fn one_sided_operations_parse_and_plan() {
    for op in Operation::ALL {
        assert_eq!(Operation::parse(op.as_str()).unwrap(), op);
    }
    assert!(Operation::RdmaRead.is_one_sided() && Operation::RdmaRead.reads());
    assert!(Operation::RdmaWriteLat.is_latency() && !Operation::RdmaWriteLat.reads());
    assert!(!Operation::Throughput.is_one_sided());
    let mut cfg = BenchConfig::default_suite();
    cfg.bindings = vec!["dxnet-tcp".into(), "raw-tcp".into()];
    let mut e = BenchEntry::new(Operation::RdmaWriteLat, 100);
    e.modes = vec![Mode::Uni, Mode::Bi];
    e.sizes = Sizes::List(vec![64]);
    cfg.benchmarks = vec![e.clone()];
    let runs: Vec<_> = cfg
        .plan()
        .unwrap()
        .into_iter()
        .flat_map(|g| g.runs)
        .collect();
    // raw-tcp has no one-sided operations; latency runs one mode.
    assert_eq!(runs.len(), 1);
    assert_eq!(runs[0].mode, Mode::Uni);
    e.sizes = Sizes::List(vec![32 << 20]);
    cfg.benchmarks = vec![e];
    assert!(cfg.validate().is_err(), "beyond the benchmark region");
    cfg.benchmarks.clear();
    cfg.params.rdma_window = 0;
    assert!(cfg.validate().is_err());
}

#[test]
fn open_loop_rates_plan_one_run_each_with_capped_counts() {
    let c = BenchConfig::from_json(
        r#"{"bindings":["dxnet-tcp","mpi-tcp"],
            "benchmarks":[{"operation":"throughput","sizes":[64],"count":1000000,
                           "rates":[0,1000,100000]}],
            "params":{"open_loop_s":2}}"#,
    )
    .unwrap();
    let groups = c.plan().unwrap();
    let dx: Vec<(u64, u64)> = groups
        .iter()
        .filter(|g| g.key.binding == "dxnet-tcp")
        .flat_map(|g| g.runs.iter().map(|r| (r.rate, r.count)))
        .collect();
    // rate x open_loop_s caps the count; closed loop keeps it.
    assert_eq!(dx, [(0, 1_000_000), (1000, 2000), (100_000, 200_000)]);
    // External programs pace nothing: closed loop only.
    let mpi: Vec<u64> = groups
        .iter()
        .filter(|g| g.key.binding == "mpi-tcp")
        .flat_map(|g| g.runs.iter().map(|r| r.rate))
        .collect();
    assert_eq!(mpi, [0]);
    let bad = r#"{"bindings":["dxnet-tcp"],
        "benchmarks":[{"operation":"rdma_write","sizes":[64],"count":10,"rates":[1000]}]}"#;
    assert!(
        BenchConfig::from_json(bad).is_err(),
        "one-sided: closed loop only"
    );
    let none = r#"{"bindings":["dxnet-tcp"],
        "benchmarks":[{"operation":"throughput","sizes":[64],"count":10,"rates":[]}]}"#;
    assert!(BenchConfig::from_json(none).is_err());
}
