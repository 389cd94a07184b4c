//! Command-line numbers of the benchmark and example binaries, checked: a flag's value that is
//! not a whole number in its range is an error naming the flag, the value and the range (the
//! binaries print it and exit with status 2), never a panic, a wrapped size or an allocation
//! that aborts.

use std::ops::RangeInclusive;

/// `value` of `flag` as a whole number in `range`.
///
/// # Errors
/// A message naming the flag, the value and the range when the value is not a whole number or
/// lies outside the range.
pub fn bounded(flag: &str, value: &str, range: RangeInclusive<usize>) -> Result<usize, String> {
    match value.parse::<usize>() {
        Ok(n) if range.contains(&n) => Ok(n),
        _ => Err(format!(
            "{flag} {value}: a whole number in {}..={}",
            range.start(),
            range.end()
        )),
    }
}

/// [`bounded`], or the message on stderr and exit status 2 (`{program}: {message}`).
pub fn bounded_or_exit(
    program: &str,
    flag: &str,
    value: &str,
    range: RangeInclusive<usize>,
) -> usize {
    bounded(flag, value, range).unwrap_or_else(|e| {
        eprintln!("{program}: {e}");
        std::process::exit(2)
    })
}

#[cfg(test)]
mod tests {
    use super::bounded;

    #[test]
    fn numbers_in_range_pass_and_the_rest_name_flag_value_and_range() {
        assert_eq!(bounded("--gpus", "1", 1..=8), Ok(1));
        assert_eq!(bounded("--gpus", "8", 1..=8), Ok(8));
        for bad in ["0", "9", "-1", "abc", "", "1.5", "18446744073709551616"] {
            assert_eq!(
                bounded("--gpus", bad, 1..=8),
                Err(format!("--gpus {bad}: a whole number in 1..=8")),
                "{bad:?}"
            );
        }
    }
}
