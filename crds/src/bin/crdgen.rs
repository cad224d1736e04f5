//! Writes the CRD manifests generated from the Rust types: `sluice-crdgen [DIR]` (default `crds/`).

fn main() -> std::io::Result<()> {
    let dir = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "crds".to_string());
    for (name, yaml) in sluice_crds::crd_yaml() {
        let path = std::path::Path::new(&dir).join(name);
        std::fs::write(&path, yaml)?;
        println!("wrote {}", path.display());
    }
    Ok(())
}
