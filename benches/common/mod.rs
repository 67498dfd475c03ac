//! What the benches share: arguments, paired rounds and the table they print.
//!
//! Each case times the engine (or the zip mapper) and a raw baseline doing the
//! least the same work needs (a plain threaded pwrite or pread loop, a memcpy,
//! a walk of the zip directory), in rounds that alternate which goes first, so
//! that a drift of the machine hits both. A row prints the median throughput
//! of each and the median of the rounds' own ratios (baseline time over the
//! engine's: 1.00 means the engine runs at the raw limit, above 1 faster).

#![allow(dead_code)] // each bench uses part of it

use std::time::Instant;

/// `cargo bench --bench NAME -- [--size 256M] [--rounds 5] [--threads 8]
/// [--records 100000] [--dir DIR] [FILTER]`
pub struct Args {
    pub size: usize,
    pub records: usize,
    pub rounds: usize,
    pub threads: usize,
    pub dir: Option<std::path::PathBuf>,
    pub filter: Option<String>,
}

impl Args {
    pub fn parse() -> Args {
        let mut a = Args {
            size: 256 << 20,
            records: 100_000,
            rounds: 5,
            threads: 8,
            dir: None,
            filter: None,
        };
        let mut it = std::env::args().skip(1);
        while let Some(arg) = it.next() {
            let mut value =
                |name: &str| it.next().unwrap_or_else(|| panic!("{name} needs a value"));
            match arg.as_str() {
                "--size" => a.size = ckptio::engine::parse_size(&value("--size")).expect("--size"),
                "--rounds" => a.rounds = value("--rounds").parse().expect("--rounds"),
                "--records" => a.records = value("--records").parse().expect("--records"),
                "--threads" => a.threads = value("--threads").parse().expect("--threads"),
                "--dir" => a.dir = Some(value("--dir").into()),
                // cargo bench passes --bench to every target.
                "--bench" => {}
                s if s.starts_with("--") => panic!("unknown option {s}"),
                s => a.filter = Some(s.to_string()),
            }
        }
        a.rounds = a.rounds.max(1);
        a
    }

    pub fn wants(&self, case: &str) -> bool {
        self.filter.as_deref().is_none_or(|f| case.contains(f))
    }
}

/// Seconds `f` takes.
pub fn time(f: impl FnOnce()) -> f64 {
    let t0 = Instant::now();
    f();
    t0.elapsed().as_secs_f64()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// One row: `rounds` rounds of `engine` and `baseline` (each returns the
/// seconds of the part it times), their order alternating; `units` done per
/// run, in `unit` ("GiB", "M records").
pub fn pair(
    case: &str,
    what: &str,
    rounds: usize,
    units: f64,
    unit: &str,
    mut engine: impl FnMut() -> f64,
    mut baseline: impl FnMut() -> f64,
) {
    let (mut e, mut b) = (Vec::new(), Vec::new());
    for r in 0..rounds {
        if r % 2 == 0 {
            b.push(baseline());
            e.push(engine());
        } else {
            e.push(engine());
            b.push(baseline());
        }
    }
    let ratios: Vec<f64> = e.iter().zip(&b).map(|(e, b)| b / e).collect();
    let (me, mb) = (median(e), median(b));
    println!(
        "{case:<14} {:>9.2} {unit}/s {:>9.2} {unit}/s {:>7.2}x   {what}",
        units / me,
        units / mb,
        median(ratios),
    );
}

pub fn header(title: &str, args: &Args) {
    println!(
        "{title}: {} rounds, {} threads, median of the rounds (ratio: median of each round's baseline time / engine time)",
        args.rounds, args.threads
    );
    println!(
        "{:<14} {:>15} {:>15} {:>8}   baseline is",
        "case", "engine", "baseline", "ratio"
    );
}
