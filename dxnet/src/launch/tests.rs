//! Launches as each launcher sets its variables (by hand: no Slurm or
//! Kubernetes here; `tests/launcher.rs` runs real `mpirun`/`mpiexec`).

use crate::config::{Config, TransportKind};

fn vars(list: &[(&str, &str)]) -> Vec<(String, String)> {
    list.iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn map(c: &Config) -> Vec<(u16, &str)> {
    c.nodes.iter().map(|n| (n.id, n.address.as_str())).collect()
}

#[test]
fn slurm_block_distribution() {
    // srun -N 3 -n 5: two tasks on n01 and n02, one on n03; this is task 3.
    let c = Config::from_vars(vars(&[
        ("SLURM_PROCID", "3"),
        ("SLURM_NTASKS", "5"),
        ("SLURM_JOB_NODELIST", "n[01-03]"),
        ("SLURM_TASKS_PER_NODE", "2(x2),1"),
        ("DXNET_PORT", "7000"),
    ]))
    .unwrap();
    assert_eq!(c.node_id, 3);
    assert_eq!(
        map(&c),
        [
            (0, "n01:7000"),
            (1, "n01:7001"),
            (2, "n02:7000"),
            (3, "n02:7001"),
            (4, "n03:7000")
        ]
    );
    assert!(c.discovery.is_none());
}

#[test]
fn open_mpi_and_mpich_ranks_on_one_host() {
    for (rank, size) in [
        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
        ("PMI_RANK", "PMI_SIZE"),
    ] {
        let c = Config::from_vars(vars(&[
            (rank, "2"),
            (size, "4"),
            ("DXNET_NODES", "127.0.0.1:9100"),
            ("DXNET_NODE_ID_OFFSET", "10"),
        ]))
        .unwrap();
        assert_eq!(c.node_id, 12, "{rank}");
        assert_eq!(
            map(&c),
            [
                (10, "127.0.0.1:9100"),
                (11, "127.0.0.1:9101"),
                (12, "127.0.0.1:9102"),
                (13, "127.0.0.1:9103")
            ]
        );
    }
}

#[test]
fn host_file_slots() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("hosts");
    std::fs::write(&f, "a slots=2\nb:1\n").unwrap();
    let c = Config::from_vars(vars(&[
        ("OMPI_COMM_WORLD_RANK", "0"),
        ("DXNET_HOSTFILE", f.to_str().unwrap()),
    ]))
    .unwrap();
    assert_eq!(map(&c), [(0, "a:22222"), (1, "a:22223"), (2, "b:22222")]);
    let e = Config::from_vars(vars(&[
        ("OMPI_COMM_WORLD_RANK", "0"),
        ("OMPI_COMM_WORLD_SIZE", "4"),
        ("DXNET_HOSTFILE", f.to_str().unwrap()),
    ]))
    .unwrap_err();
    assert!(
        e.to_string()
            .contains("4 ranks but the host list has room for 3"),
        "{e}"
    );
}

#[test]
fn kubernetes_statefulset_ordinal_and_headless_service() {
    let c = Config::from_vars(vars(&[
        ("HOSTNAME", "dxkv-storage-2"),
        ("DXNET_NODE_ID", "ordinal"),
        ("DXNET_SEEDS", "dxkv-storage.default.svc.cluster.local"),
        ("DXNET_ADDRESS", "10.1.2.3:22222"),
    ]))
    .unwrap();
    assert_eq!(c.node_id, 2);
    assert_eq!(map(&c), [(2, "10.1.2.3:22222")]);
    let d = c.discovery.unwrap();
    assert_eq!(d.seeds, ["dxkv-storage.default.svc.cluster.local:22222"]);
    // Without DXNET_ADDRESS the node is at its host name.
    let c = Config::from_vars(vars(&[
        ("HOSTNAME", "kv-0"),
        ("DXNET_NODE_ID", "ordinal"),
        ("DXNET_SEEDS", "kv:7000"),
        ("DXNET_PORT", "7000"),
    ]))
    .unwrap();
    assert_eq!(map(&c), [(0, "kv-0:7000")]);
    let e =
        Config::from_vars(vars(&[("HOSTNAME", "kv"), ("DXNET_NODE_ID", "ordinal")])).unwrap_err();
    assert!(e.to_string().contains("does not end in -<number>"), "{e}");
}

#[test]
fn overrides_layer_over_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("node.toml");
    std::fs::write(
        &f,
        "handler_threads = 3\n[limits]\norb_size = 65536\n[[nodes]]\nid = 0\naddress = \"h0:1\"\n[[nodes]]\nid = 1\naddress = \"h1:1\"\n",
    )
    .unwrap();
    let path = f.to_str().unwrap();
    let c = Config::from_vars(vars(&[
        ("DXNET_CONFIG", path),
        ("DXNET_NODE_ID", "1"),
        ("DXNET_LIMITS__ORB_SIZE", "1048576"),
        ("DXNET_CLUSTER_SECRET", "change me"),
        ("DXNET_TRANSPORT", "loopback"),
        ("DXNET_PARK__ADAPTIVE", "false"),
        // A launcher's rank does not replace the file's node map.
        ("SLURM_PROCID", "0"),
        ("SLURM_JOB_NODELIST", "x[1-9]"),
    ]))
    .unwrap();
    assert_eq!(c.node_id, 1);
    assert_eq!(c.handler_threads, 3);
    assert_eq!(c.limits.orb_size, 1 << 20);
    assert_eq!(c.cluster_secret.as_deref(), Some("change me"));
    assert_eq!(c.transport, TransportKind::Loopback);
    assert!(!c.park.adaptive);
    assert_eq!(map(&c), [(0, "h0:1"), (1, "h1:1")]);

    // The file's own node id wins over a rank; DXNET_NODE_ID over both.
    std::fs::write(&f, "node_id = 1\n[[nodes]]\nid = 1\naddress = \"h:1\"\n").unwrap();
    let c = Config::from_vars(vars(&[("DXNET_CONFIG", path), ("PMI_RANK", "0")])).unwrap();
    assert_eq!(c.node_id, 1);

    // JSON files too, absent sections as null.
    let j = dir.path().join("node.json");
    std::fs::write(
        &j,
        r#"{"nodes": [{"id": 0, "address": "h:1"}], "tls": null}"#,
    )
    .unwrap();
    let c = Config::from_vars(vars(&[("DXNET_CONFIG", j.to_str().unwrap())])).unwrap();
    assert_eq!((c.node_id, c.tls), (0, None));
}

#[test]
fn typos_and_bad_values_are_errors_naming_them() {
    let e = Config::from_vars(vars(&[("DXNET_IB__DEVCE", "rxe0")])).unwrap_err();
    let m = e.to_string();
    assert!(
        m.contains("ib.devce") && m.contains("DXNET_IB__DEVCE"),
        "{m}"
    );
    let e = Config::from_vars(vars(&[("DXNET_HANDLER_THREADS", "many")])).unwrap_err();
    assert!(e.to_string().contains("handler_threads"), "{e}");
    let e = Config::from_vars(vars(&[("DXNET_NODE_ID", "x")])).unwrap_err();
    assert!(e.to_string().contains("DXNET_NODE_ID"), "{e}");
    let e = Config::from_vars(vars(&[("SLURM_PROCID", "3")])).unwrap_err();
    assert!(e.to_string().contains("no node map"), "{e}");
    let e = Config::from_vars(vars(&[("PMI_RANK", "0"), ("DXNET_NODES", "n[1-")])).unwrap_err();
    assert!(e.to_string().contains("DXNET_NODES"), "{e}");
    let e = Config::from_vars(vars(&[
        ("PMI_RANK", "0"),
        ("PMI_SIZE", "2"),
        ("DXNET_NODES", "a:65535"),
    ]))
    .unwrap_err();
    assert!(e.to_string().contains("beyond 65535"), "{e}");
    let e = Config::from_vars(vars(&[("DXNET_CONFIG", "/nonexistent/node.toml")])).unwrap_err();
    assert!(e.to_string().contains("cannot read"), "{e}");
}

#[test]
fn nothing_set_is_the_default_configuration() {
    let c = Config::from_vars(vars(&[("PATH", "/bin"), ("HOSTNAME", "h")])).unwrap();
    assert_eq!(c, Config::default());
}
