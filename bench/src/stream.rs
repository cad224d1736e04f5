//! Stream and host_call benchmarks.

use crate::report::{Row, Table};

pub async fn bench(_table: &mut Table) -> anyhow::Result<()> {
    Ok(())
}

pub async fn host_call(_table: &mut Table) -> anyhow::Result<()> {
    Ok(())
}
