//! The table `make bench` prints.

use std::time::Duration;

pub(crate) fn percentile(samples: &[Duration], p: f64) -> Duration {
    if samples.is_empty() {
        return Duration::ZERO;
    }
    let mut s = samples.to_vec();
    s.sort();
    let idx = ((p / 100.0) * (s.len() - 1) as f64).round() as usize;
    s[idx.min(s.len() - 1)]
}

fn fmt(d: Duration) -> String {
    let us = d.as_secs_f64() * 1e6;
    if us < 1000.0 {
        format!("{us:.0} µs")
    } else if us < 1e6 {
        format!("{:.2} ms", us / 1000.0)
    } else {
        format!("{:.2} s", us / 1e6)
    }
}

pub(crate) struct Row {
    what: String,
    value: String,
    target: String,
}

impl Row {
    pub(crate) fn latency(what: &str, samples: &[Duration]) -> Self {
        let value = format!(
            "p50 {} · p99 {} (n={})",
            fmt(percentile(samples, 50.0)),
            fmt(percentile(samples, 99.0)),
            samples.len()
        );
        Self {
            what: what.into(),
            value,
            target: String::new(),
        }
    }

    pub(crate) fn value(what: &str, value: String) -> Self {
        Self {
            what: what.into(),
            value,
            target: String::new(),
        }
    }

    pub(crate) fn target(mut self, t: &str) -> Self {
        self.target = t.into();
        self
    }
}

#[derive(Default)]
pub(crate) struct Table(Vec<Row>);

impl Table {
    pub(crate) fn push(&mut self, row: Row) {
        println!("  {} … {}", row.what.trim(), row.value);
        self.0.push(row);
    }

    pub(crate) fn print(&self) {
        let w0 = self
            .0
            .iter()
            .map(|r| r.what.chars().count())
            .max()
            .unwrap_or(0);
        let w1 = self
            .0
            .iter()
            .map(|r| r.value.chars().count())
            .max()
            .unwrap_or(0);
        println!();
        println!("| {:w0$} | {:w1$} | target |", "measure", "result");
        println!("|{}|{}|--------|", "-".repeat(w0 + 2), "-".repeat(w1 + 2));
        for r in &self.0 {
            println!("| {:w0$} | {:w1$} | {} |", r.what, r.value, r.target);
        }
    }
}
