//! `tracing`: what tracing costs the real `dispatcher` binary draining unkeyed rows, every
//! variant once per round, interleaved (docs/tracing.md, BENCHMARKS.md "Tracing"):
//!
//! - every contender with tracing off over rows without a context (today's rows: the
//!   before/after comparison of `--dispatcher-bin before=… --dispatcher-bin after=…`);
//! - the last contender with tracing off over rows that all carry a writer's context (passed on
//!   as the attribute, no span);
//! - the last contender exporting to a stand-in OTLP receiver, 10 % sampled (one writer in ten
//!   sampled, `--trace-sample-ratio 0.1`) and 100 % sampled.
//!
//! Figures: msgs/s and the dispatcher's CPU µs per message, each round and the medians, as a
//! ratio to the last contender's "off".

use anyhow::Result;
use harness::otlp::OtlpReceiver;

use crate::binary::Drained;
use crate::pipeline::{BenchTopic, Common, cpu_split, env, run_binary};
use crate::report::{load_average, summary};
use crate::scratch::Scratch;

#[derive(Debug, Clone, clap::Args)]
pub struct TracingArgs {
    #[command(flatten)]
    pub common: Common,
    /// Messages per drain.
    #[arg(long, default_value_t = 100_000)]
    pub rows: usize,
    /// Rounds (every variant once per round, interleaved; medians reported).
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Dispatcher workers.
    #[arg(long, default_value_t = 4)]
    pub workers: usize,
}

/// One measured variant: which binary, which rows, which settings.
struct Variant {
    label: String,
    contender: usize,
    /// `None`: rows without a context; `Some(n)`: every row with one, one in `n` sampled.
    sampled_every: Option<usize>,
    /// The sampling ratio when tracing is on.
    ratio: Option<f64>,
}

pub async fn tracing_bench(db: &Scratch, args: &TracingArgs) -> Result<()> {
    let contenders = args.common.contenders()?;
    let receiver = OtlpReceiver::start(false).await;
    let last = contenders.len() - 1;
    let mut variants: Vec<Variant> = contenders
        .iter()
        .enumerate()
        .map(|(i, c)| Variant {
            label: format!("{} off", c.label),
            contender: i,
            sampled_every: None,
            ratio: None,
        })
        .collect();
    let name = &contenders[last].label;
    variants.push(Variant {
        label: format!("{name} off, rows with a context"),
        contender: last,
        sampled_every: Some(10),
        ratio: None,
    });
    for (label, every, ratio) in [("10 %", 10, 0.1), ("100 %", 1, 1.0)] {
        variants.push(Variant {
            label: format!("{name} on, {label} sampled"),
            contender: last,
            sampled_every: Some(every),
            ratio: Some(ratio),
        });
    }
    let c = &args.common;
    BenchTopic::around(c, "tracing", async |topic: &str| {
        let mut results: Vec<Vec<Drained>> = variants.iter().map(|_| Vec::new()).collect();
        for round in 1..=args.rounds {
            for (v, figures) in variants.iter().zip(results.iter_mut()) {
                match v.sampled_every {
                    None => db.refill(args.rows, c.payload_bytes, crate::dispatch::Keys(None), topic).await?,
                    Some(every) => db.refill_traced(args.rows, c.payload_bytes, topic, every).await?,
                };
                let mut settings = env(args.workers);
                if let Some(ratio) = v.ratio {
                    settings.push(("OUTBOX_TRACE_ENDPOINT", receiver.endpoint()));
                    settings.push(("OUTBOX_TRACE_SAMPLE_RATIO", ratio.to_string()));
                }
                let spans_before = receiver.count();
                let drained = run_binary(
                    db,
                    &contenders[v.contender],
                    &c.pubsub_emulator_host,
                    &settings,
                    1,
                    args.rows,
                )
                .await?;
                println!(
                    "round {round}/{}: {}: {:.0} msgs/s; CPU µs/msg (dispatcher / PostgreSQL / emulator) {}; spans received {}; load {}",
                    args.rounds,
                    v.label,
                    drained.rate,
                    cpu_split(&drained.cpu_us),
                    receiver.count() - spans_before,
                    load_average()
                );
                figures.push(drained);
            }
        }
        let base = variants
            .iter()
            .position(|v| v.contender == last && v.sampled_every.is_none())
            .unwrap_or(0);
        let median = |f: &[Drained], of: &dyn Fn(&Drained) -> f64| summary(f.iter().map(of)).median;
        let base_rate = median(&results[base], &|d| d.rate);
        let base_cpu = median(&results[base], &|d| d.cpu_us[0]);
        println!(
            "\n{} unkeyed rows of {} B, {} workers, {} rounds; medians, ratios to \"{}\"; load at end {}",
            args.rows,
            c.payload_bytes,
            args.workers,
            args.rounds,
            variants[base].label,
            load_average()
        );
        for (v, figures) in variants.iter().zip(&results) {
            let rate = median(figures, &|d| d.rate);
            let cpu = median(figures, &|d| d.cpu_us[0]);
            println!(
                "  {:<40} {:>8.0} msgs/s ({:.3}); dispatcher CPU {:.2} µs/msg ({:.3})",
                v.label,
                rate,
                rate / base_rate,
                cpu,
                cpu / base_cpu
            );
        }
        Ok(())
    })
    .await
}
