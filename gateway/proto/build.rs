//! Compiles the gRPC API (sluice/v1/gateway.proto, beside this file) and records a descriptor set for
//! server reflection.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    tonic_prost_build::configure()
        .file_descriptor_set_path(out.join("sluice_descriptor.bin"))
        .compile_protos(&["sluice/v1/gateway.proto"], &["."])?;
    println!("cargo:rerun-if-changed=sluice");
    Ok(())
}
