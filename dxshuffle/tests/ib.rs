//! The shuffle over InfiniBand/RoCE (real RDMA WRITEs into the segments):
//! run by `scripts/test-ib.sh` in the Soft-RoCE VM; skipped without a
//! device (`RDMA_DEV` unset).

mod common;

use common::{run, Case, Kind};
use dxshuffle::Mode;

fn device() -> bool {
    let d = std::env::var("RDMA_DEV").is_ok();
    if !d {
        println!("skipped: no RDMA device (RDMA_DEV unset); run scripts/test-ib.sh");
    }
    d
}

#[test]
fn ib_one_sided_and_messages() {
    if !device() {
        return;
    }
    for mode in [Mode::OneSided, Mode::Messages] {
        run(Case {
            kind: Kind::Ib,
            mode,
            procs: 2,
            threads: 4,
            segment: 4096,
            batch: 1024,
            per_worker: 200,
        });
    }
}

#[test]
fn ib_tiny_segments_force_back_pressure_and_wraps() {
    if !device() {
        return;
    }
    run(Case {
        kind: Kind::Ib,
        mode: Mode::OneSided,
        procs: 2,
        threads: 2,
        segment: 128,
        batch: 40,
        per_worker: 150,
    });
}
