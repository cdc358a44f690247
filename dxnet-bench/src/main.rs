//! `dxnet-bench`: see the crate README.

fn main() {
    match dxnet_bench::cli::main() {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("dxnet-bench: {e:#}");
            std::process::exit(2);
        }
    }
}
