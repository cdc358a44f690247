//! Host-side behaviour without RDMA: loading failures and missing devices
//! must give clear errors (these run everywhere, no device needed).

use dxnet_verbs::{Context, Error, Library};

#[test]
fn missing_library_is_reported_clearly() {
    let err = Library::load_from("libdxnet-no-such-ibverbs.so.1").unwrap_err();
    assert!(matches!(err, Error::LibraryNotAvailable { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(msg.starts_with("libibverbs not available"), "{msg}");
    assert!(msg.contains("libdxnet-no-such-ibverbs.so.1"), "{msg}");
    assert!(err.is_unavailable());
}

#[test]
fn library_without_verbs_symbols_is_reported_clearly() {
    // libc is loadable but has no ibv_* symbols.
    let err = Library::load_from("libc.so.6").unwrap_err();
    assert!(
        matches!(
            err,
            Error::MissingSymbol {
                symbol: "ibv_get_device_list",
                ..
            }
        ),
        "{err:?}"
    );
    assert!(err
        .to_string()
        .starts_with("libibverbs not available: libc.so.6 has no ibv_get_device_list"));
}

/// On a host without RDMA (no rdma-core, or no kernel support/devices),
/// opening a device must fail with one of the two clear errors. Skipped
/// where a device exists (e.g. inside the test VM).
#[test]
fn open_without_device_fails_clearly() {
    let lib = match Library::load() {
        Ok(lib) => lib,
        Err(e) => {
            assert!(e.to_string().starts_with("libibverbs not available"), "{e}");
            assert!(Context::open(None)
                .unwrap_err()
                .to_string()
                .starts_with("libibverbs not available"));
            return;
        }
    };
    let devices = lib.devices();
    match devices {
        Ok(d) if !d.is_empty() => {
            eprintln!("skipped: this host has RDMA devices {d:?}");
            // a name that does not exist still gives a clear error
            let err = lib.open(Some("no-such-device")).unwrap_err();
            assert!(
                err.to_string()
                    .starts_with("RDMA device 'no-such-device' not found"),
                "{err}"
            );
        }
        _ => {
            let err = Context::open(None).unwrap_err();
            assert!(matches!(err, Error::NoDevice { .. }), "{err:?}");
            assert!(err.to_string().starts_with("no RDMA device found"), "{err}");
            let err = Context::open(Some("rxe0")).unwrap_err();
            assert!(err.to_string().starts_with("no RDMA device found"), "{err}");
        }
    }
}

#[test]
fn errno_texts() {
    let e = Error::Verbs {
        call: "ibv_create_qp",
        errno: libc_enomem(),
    };
    assert_eq!(
        e.to_string(),
        "ibv_create_qp failed: Cannot allocate memory (errno 12)"
    );
    let e = Error::Post {
        call: "ibv_post_send",
        errno: 22,
        bad_index: 3,
    };
    assert_eq!(
        e.to_string(),
        "ibv_post_send failed at work request 3 of the chain: Invalid argument (errno 22)"
    );
    let e = Error::DeviceNotFound {
        name: "mlx5_9".into(),
        available: vec!["rxe0".into(), "mlx5_0".into()],
    };
    assert_eq!(
        e.to_string(),
        "RDMA device 'mlx5_9' not found (available: rxe0, mlx5_0)"
    );
}

fn libc_enomem() -> i32 {
    12
}
