//! The planner's step-time oracle that simulates: the AF-Pipe program of an allocation run by
//! the event loop of [`crate::simulator`].

use crate::allocator::search::StepTimeOracle;
use crate::allocator::Allocation;
use crate::cost::{Apart, CostModel, Sides};
use crate::error::Result;

/// Step-time oracle that simulates the AF-Pipe program of an allocation
/// ([`crate::schedule::afpipe::AfPipe::step_time`]: the step time of `build_afpipe`'s schedule, bit
/// for bit, without listing its ops).
#[derive(Debug, Clone)]
pub struct SimulatorOracle {
    /// The cost model the schedules are built from (the attention side's, when the expert side
    /// runs elsewhere).
    pub cost: CostModel,
    /// The expert side's cost model and where the two sides are, when the expert side runs on
    /// another pool of a mixed cluster.
    pub experts: Option<(CostModel, Apart)>,
}

impl SimulatorOracle {
    /// Both sides on `cost`'s cluster.
    pub fn new(cost: CostModel) -> Self {
        Self { cost, experts: None }
    }

    /// Where each side runs.
    pub fn sides(&self) -> Sides<'_> {
        match &self.experts {
            None => Sides::one(&self.cost),
            Some((ffn, apart)) => Sides { attention: &self.cost, ffn, apart: Some(*apart) },
        }
    }
}

impl StepTimeOracle for SimulatorOracle {
    fn step_time(&mut self, allocation: &Allocation) -> Result<f64> {
        crate::schedule::afpipe::AfPipe::on(self.sides(), allocation)?.step_time()
    }
    /// Simulates the allocations on all available cores (each simulation is sequential).
    fn step_times(&mut self, allocations: &[Allocation]) -> Result<Vec<f64>> {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(allocations.len());
        if threads <= 1 {
            return allocations.iter().map(|a| self.step_time(a)).collect();
        }
        let this = &*self;
        let next = std::sync::atomic::AtomicUsize::new(0);
        let mut times: Vec<Option<Result<f64>>> = (0..allocations.len()).map(|_| None).collect();
        let done: Vec<Vec<(usize, Result<f64>)>> = std::thread::scope(|scope| {
            let workers: Vec<_> = (0..threads)
                .map(|_| {
                    scope.spawn(|| {
                        let mut out = Vec::new();
                        loop {
                            let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            let Some(a) = allocations.get(i) else { break out };
                            out.push((
                                i,
                                crate::schedule::afpipe::AfPipe::on(this.sides(), a).and_then(|p| p.step_time()),
                            ));
                        }
                    })
                })
                .collect();
            workers.into_iter().map(|w| w.join().expect("a simulation thread panicked")).collect()
        });
        for (i, t) in done.into_iter().flatten() {
            times[i] = Some(t);
        }
        times.into_iter().map(|t| t.expect("every allocation simulated")).collect()
    }
    fn respects_lower_bound(&self) -> bool {
        true
    }
    fn name(&self) -> &str {
        "simulator"
    }
}
