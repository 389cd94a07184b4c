//! How busy other processes kept the machine while a benchmark ran, from Linux's `/proc/stat`
//! and `/proc/self/stat`: a benchmark whose figures were taken while other work competed for
//! the cores says so next to them.

/// CPU time counters at one instant.
#[derive(Clone, Copy, Debug)]
pub struct CpuTimes {
    /// Jiffies of all CPUs, busy or idle.
    total: u64,
    /// Busy jiffies of all CPUs.
    busy: u64,
    /// Jiffies this process used (all its threads).
    own: u64,
}

impl CpuTimes {
    /// Reads `/proc/stat` and `/proc/self/stat`; `None` where they do not exist.
    pub fn now() -> Option<CpuTimes> {
        let stat = std::fs::read_to_string("/proc/stat").ok()?;
        let own_stat = std::fs::read_to_string("/proc/self/stat").ok()?;
        Self::parse(&stat, &own_stat)
    }

    fn parse(stat: &str, own_stat: &str) -> Option<CpuTimes> {
        let fields: Vec<u64> = stat
            .lines()
            .next()?
            .split_whitespace()
            .skip(1)
            .take(8)
            .map(|f| f.parse().ok())
            .collect::<Option<_>>()?;
        let total: u64 = fields.iter().sum();
        let idle = fields.get(3)? + fields.get(4)?;
        // Fields after the parenthesised command name; utime and stime are the 12th and 13th.
        let mut after = own_stat[own_stat.rfind(')')? + 1..]
            .split_whitespace()
            .skip(11);
        let own = after.next()?.parse::<u64>().ok()? + after.next()?.parse::<u64>().ok()?;
        Some(CpuTimes {
            total,
            busy: total - idle,
            own,
        })
    }

    /// Average number of cores (of `cores`) that other processes kept busy between `self` and
    /// `later`.
    pub fn others_cores(self, later: CpuTimes, cores: f64) -> Option<f64> {
        let total = later.total.checked_sub(self.total)?;
        let others =
            (later.busy.checked_sub(self.busy)?).saturating_sub(later.own.saturating_sub(self.own));
        (total > 0).then(|| others as f64 / total as f64 * cores)
    }
}

#[cfg(test)]
mod tests {
    use super::CpuTimes;

    #[test]
    fn others_exclude_this_process() {
        let own = |u: u64, s: u64| format!("42 (a b) R 1 2 3 4 5 6 7 8 9 10 {u} {s} 0 0");
        // user nice system idle iowait irq softirq steal
        let a = CpuTimes::parse("cpu 100 0 0 100 0 0 0 0\ncpu0 1", &own(10, 0)).unwrap();
        let b = CpuTimes::parse("cpu 200 0 0 200 0 0 0 0\n", &own(50, 10)).unwrap();
        // 200 jiffies passed, 100 busy, 50 of them ours: others kept 0.25 of 1 core busy
        // (0.5 of 2 cores).
        assert_eq!(a.others_cores(b, 2.0), Some(0.5));
        assert_eq!(b.others_cores(a, 2.0), None);
        assert!(CpuTimes::parse("", &own(0, 0)).is_none());
    }
}
