//! Gradient reductions completed in stages, so that work on gradients that are final already
//! (the gradient norm's sum of squares) runs beside the reductions still in flight.

use lowbit_device::Device;

use crate::Result;

/// The gradient reductions a step waits for, completed one stage at a time in the order they
/// were launched: stage 0 is final already, stage `k` (1 to [`Self::stages`]) once
/// [`Self::complete_through`] has reached it. Handed to
/// [`crate::Optimizer::local_sum_squares_overlapped`] by
/// [`crate::protocol::finish_grad_sync_and_step`]: one stage per bucket group still in flight.
pub struct StagedReductions<'a> {
    stage_of: &'a dyn Fn(usize) -> usize,
    stages: usize,
    done: usize,
    complete: &'a mut dyn FnMut(&mut Device, usize) -> Result<()>,
}

impl<'a> StagedReductions<'a> {
    /// `stages` stages after stage 0; `stage_of(param)` is the stage at which parameter
    /// `param`'s reduced gradient is final (values past `stages` count as the last);
    /// `complete(dev, k)` completes stage `k` and is called once per stage, in order.
    pub fn new(
        stages: usize,
        stage_of: &'a dyn Fn(usize) -> usize,
        complete: &'a mut dyn FnMut(&mut Device, usize) -> Result<()>,
    ) -> Self {
        StagedReductions {
            stage_of,
            stages,
            done: 0,
            complete,
        }
    }

    /// The number of stages after stage 0.
    pub fn stages(&self) -> usize {
        self.stages
    }

    /// The stage at which parameter `param`'s reduced gradient is final.
    pub fn stage_of(&self, param: usize) -> usize {
        (self.stage_of)(param).min(self.stages)
    }

    /// Completes every stage up to and including `k` not completed yet.
    ///
    /// # Errors
    /// Those of the completion (collective, buffer and device errors).
    pub fn complete_through(&mut self, dev: &mut Device, k: usize) -> Result<()> {
        while self.done < k.min(self.stages) {
            (self.complete)(dev, self.done + 1)?;
            self.done += 1;
        }
        Ok(())
    }

    /// Completes every stage left.
    ///
    /// # Errors
    /// As [`Self::complete_through`].
    pub fn complete_all(&mut self, dev: &mut Device) -> Result<()> {
        self.complete_through(dev, self.stages)
    }
}

#[cfg(test)]
mod tests {
    use lowbit_device::Device;

    use super::StagedReductions;

    /// Stages complete once each, in order, never past the last; `stage_of` is clamped.
    #[test]
    fn stages_complete_once_in_order() {
        let mut dev = Device::cpu();
        let mut calls = Vec::new();
        let mut complete = |_: &mut Device, k: usize| {
            calls.push(k);
            Ok(())
        };
        let stage_of = |p: usize| p;
        {
            let mut r = StagedReductions::new(3, &stage_of, &mut complete);
            assert_eq!((r.stages(), r.stage_of(1), r.stage_of(9)), (3, 1, 3));
            r.complete_through(&mut dev, 2).unwrap();
            r.complete_through(&mut dev, 1).unwrap();
            r.complete_through(&mut dev, 7).unwrap();
            r.complete_all(&mut dev).unwrap();
        }
        assert_eq!(calls, [1, 2, 3]);
    }
}
