//! With the `cuda` feature: compiles occult's CUDA kernels (`kernels/*.cu`) to PTX with nvcc,
//! as candle's own kernels are built (cudaforge: nvcc from `PATH` or `CUDA_ROOT`, the GPU from
//! `CUDA_COMPUTE_CAP` or the one present), into `$OUT_DIR/ptx.rs`. Without it: nothing.

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    #[cfg(feature = "cuda")]
    {
        println!("cargo::rerun-if-changed=kernels");
        let out = std::path::PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
        let ptx = cudaforge::KernelBuilder::new()
            .source_dir("kernels")
            .arg("-std=c++17")
            .arg("-O3")
            .build_ptx()
            .unwrap_or_else(|e| panic!("compiling occult's CUDA kernels (kernels/*.cu): {e}"));
        ptx.write(out.join("ptx.rs"))
            .unwrap_or_else(|e| panic!("writing ptx.rs: {e}"));
    }
}
