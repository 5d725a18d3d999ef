//! Regenerates `docs/paper-reproduction.md` and its figures: the same library call as
//! `disagmoe reproduce-paper`, without building the tensor crates.
//!
//! `cargo run -p disagmoe-core --release --example reproduce_paper` (from the workspace root).

use disagmoe_core::reproduce::{reproduce_paper, ReproduceOptions};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let options = ReproduceOptions {
        out: "docs/paper-reproduction.md".into(),
        img_dir: "docs/img".into(),
        cluster: "h800x16".into(),
        mixes: disagmoe_core::pools::MIX_PRESETS.iter().map(|(name, _)| name.to_string()).collect(),
    };
    let settings = reproduce_paper(&options)?;
    println!("wrote {} ({settings} settings simulated)", options.out.display());
    Ok(())
}
