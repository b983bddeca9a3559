//! Exact decimal text: NUMERIC/BIGNUMERIC normalisation and TIMESTAMP seconds → microseconds.
//!
//! BigQuery sends NUMERIC as decimal text whose form varies (`"12.500"`, `"12.500000000"`,
//! `"-1E-9"`), and TIMESTAMP either as integer microseconds or as float seconds (`"1.7934912E9"`).
//! Nothing here goes through `f64`: the digits are kept as text and shifted by the exponent, so a
//! 77-digit BIGNUMERIC survives exactly and equal values always render the same way.

/// `0001-01-01T00:00:00Z`, BigQuery's earliest TIMESTAMP, in UNIX microseconds.
pub const MIN_TIMESTAMP_MICROS: i64 = -62_135_596_800_000_000;

/// `9999-12-31T23:59:59.999999Z`, BigQuery's latest TIMESTAMP, in UNIX microseconds.
pub const MAX_TIMESTAMP_MICROS: i64 = 253_402_300_799_999_999;

/// How far past either end of the range a float-seconds cell may round (one millisecond: far
/// more than a double's spacing there, ~31 µs, and far less than any real distance).
const FLOAT_SLACK_MICROS: i64 = 1_000;

/// Longest plain rendering accepted (BIGNUMERIC needs 78 characters; leave headroom, refuse
/// absurd exponents such as `1E999999999` instead of allocating them).
const MAX_PLAIN_LEN: usize = 200;

/// A parsed decimal: `(-1)^negative × digits × 10^exponent`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decimal {
    negative: bool,
    /// ASCII digits without leading or trailing zeros; empty means zero.
    digits: String,
    exponent: i64,
}

/// Why a text is not a decimal we can represent.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecimalError {
    /// Not `[+-]digits[.digits][e[+-]digits]`.
    #[error("not a decimal number")]
    Syntax,
    /// The exponent would need an absurdly long rendering.
    #[error("exponent out of range")]
    Range,
}

impl Decimal {
    /// Parses `[+-]digits[.digits][(e|E)[+-]digits]` (at least one mantissa digit).
    pub fn parse(text: &str) -> Result<Self, DecimalError> {
        let (negative, rest) = match text.as_bytes().first() {
            Some(b'-') => (true, &text[1..]),
            Some(b'+') => (false, &text[1..]),
            _ => (false, text),
        };
        let (mantissa, exp_text) = match rest.find(['e', 'E']) {
            Some(i) => (&rest[..i], Some(&rest[i + 1..])),
            None => (rest, None),
        };
        let (int_part, frac_part) = mantissa.split_once('.').unwrap_or((mantissa, ""));
        let all_digits = |s: &str| s.bytes().all(|b| b.is_ascii_digit());
        if int_part.len() + frac_part.len() == 0 || !all_digits(int_part) || !all_digits(frac_part)
        {
            return Err(DecimalError::Syntax);
        }
        let mut exponent: i64 = match exp_text {
            None => 0,
            Some(e) => {
                let body = e.strip_prefix(['+', '-']).unwrap_or(e);
                if body.is_empty() || !all_digits(body) {
                    return Err(DecimalError::Syntax);
                }
                e.parse::<i64>().map_err(|_| DecimalError::Range)?
            }
        };
        exponent = exponent
            .checked_sub(frac_part.len() as i64)
            .ok_or(DecimalError::Range)?;
        let mut digits: String = int_part.chars().chain(frac_part.chars()).collect();
        let leading = digits.bytes().take_while(|&b| b == b'0').count();
        digits.drain(..leading);
        let trailing = digits.bytes().rev().take_while(|&b| b == b'0').count();
        digits.truncate(digits.len() - trailing);
        exponent += trailing as i64;
        if digits.is_empty() {
            return Ok(Self {
                negative: false,
                digits,
                exponent: 0,
            });
        }
        let width = digits.len() as i64 + exponent.abs();
        if width > MAX_PLAIN_LEN as i64 {
            return Err(DecimalError::Range);
        }
        Ok(Self {
            negative,
            digits,
            exponent,
        })
    }

    /// The shortest plain rendering: no exponent, no trailing fractional zeros, `0` for zero.
    pub fn to_plain_string(&self) -> String {
        if self.digits.is_empty() {
            return "0".to_owned();
        }
        let mut out = String::with_capacity(self.digits.len() + 4);
        if self.negative {
            out.push('-');
        }
        if self.exponent >= 0 {
            out.push_str(&self.digits);
            out.extend(std::iter::repeat_n('0', self.exponent as usize));
            return out;
        }
        let point = self.digits.len() as i64 + self.exponent;
        if point > 0 {
            let (int, frac) = self.digits.split_at(point as usize);
            out.push_str(int);
            out.push('.');
            out.push_str(frac);
        } else {
            out.push_str("0.");
            out.extend(std::iter::repeat_n('0', (-point) as usize));
            out.push_str(&self.digits);
        }
        out
    }

    /// `self × 10^6` rounded to the nearest integer (halves away from zero), if it fits an i64.
    pub fn to_micros(&self) -> Option<i64> {
        if self.digits.is_empty() {
            return Some(0);
        }
        let shift = self.exponent + 6;
        let magnitude: i128 = if shift >= 0 {
            let base: i128 = self.digits.parse().ok()?;
            base.checked_mul(10i128.checked_pow(u32::try_from(shift).ok()?)?)?
        } else {
            let keep = self.digits.len() as i64 + shift;
            if keep < 0 {
                0
            } else {
                let (int, dropped) = self.digits.split_at(keep as usize);
                let int: i128 = if int.is_empty() { 0 } else { int.parse().ok()? };
                let round_up = dropped.as_bytes().first().is_some_and(|&d| d >= b'5');
                int + i128::from(round_up)
            }
        };
        let signed = if self.negative { -magnitude } else { magnitude };
        i64::try_from(signed).ok()
    }
}

/// Parses a TIMESTAMP cell in either wire form into UNIX microseconds: integer microseconds
/// (`formatOptions.useInt64Timestamp`, which the producer asks for on every call, and bqemulator
/// always) or float seconds (`"1.7934912E9"`, `"1793491200.5"`: real BigQuery's default, kept as
/// a fallback). An integer text is microseconds; anything with a point or an exponent is seconds.
///
/// Float seconds are exact below 2^33 s (year 2242); above, a double is up to ~31 µs coarse and
/// the nearest microsecond is the best answer there is. A float that rounded just past either end
/// of BigQuery's range (`9999-12-31 23:59:59.999999` becomes `2.534023008E11`, one microsecond
/// later) is the end itself: BigQuery holds nothing beyond it. Anything else outside
/// 0001-01-01..9999-12-31 is refused.
pub fn timestamp_micros(text: &str) -> Result<i64, DecimalError> {
    let body = text.strip_prefix('-').unwrap_or(text);
    let micros = if !body.is_empty() && body.bytes().all(|b| b.is_ascii_digit()) {
        text.parse::<i64>().map_err(|_| DecimalError::Range)?
    } else {
        let micros = Decimal::parse(text)?
            .to_micros()
            .ok_or(DecimalError::Range)?;
        if micros > MAX_TIMESTAMP_MICROS && micros - MAX_TIMESTAMP_MICROS <= FLOAT_SLACK_MICROS {
            MAX_TIMESTAMP_MICROS
        } else if micros < MIN_TIMESTAMP_MICROS
            && MIN_TIMESTAMP_MICROS - micros <= FLOAT_SLACK_MICROS
        {
            MIN_TIMESTAMP_MICROS
        } else {
            micros
        }
    };
    if (MIN_TIMESTAMP_MICROS..=MAX_TIMESTAMP_MICROS).contains(&micros) {
        Ok(micros)
    } else {
        Err(DecimalError::Range)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decimals_normalise_to_one_plain_form() {
        let cases = [
            ("12.500", "12.5"),
            ("12.500000000", "12.5"),
            ("-1E-9", "-0.000000001"),
            ("0E-9", "0"),
            ("-0", "0"),
            ("-0.000", "0"),
            ("1.5E+2", "150"),
            ("1e2", "100"),
            (".5", "0.5"),
            ("+7.", "7"),
            ("007.0100", "7.01"),
            ("-1.5000000000", "-1.5"),
            (
                "99999999999999999999999999999.999999999",
                "99999999999999999999999999999.999999999",
            ),
            (
                "-99999999999999999999999999999.999999999",
                "-99999999999999999999999999999.999999999",
            ),
            (
                "578960446186580977117854925043439539266.34992332820282019728792003956564819967",
                "578960446186580977117854925043439539266.34992332820282019728792003956564819967",
            ),
            (
                "-5.7896044618658097711785492504343953926634992332820282019728792003956564819968E+38",
                "-578960446186580977117854925043439539266.34992332820282019728792003956564819968",
            ),
            ("1E-38", "0.00000000000000000000000000000000000001"),
        ];
        for (input, want) in cases {
            let got = Decimal::parse(input).map(|d| d.to_plain_string());
            assert_eq!(got.as_deref(), Ok(want), "normalising {input:?}");
        }
    }

    #[test]
    fn malformed_decimals_are_refused() {
        for bad in [
            "",
            "-",
            ".",
            "1.2.3",
            "abc",
            "1e",
            "1e+",
            "NaN",
            "1_000",
            "1E999999999",
            "0x10",
        ] {
            assert!(Decimal::parse(bad).is_err(), "{bad:?} should not parse");
        }
    }

    #[test]
    fn both_timestamp_wire_forms_give_the_same_microseconds() {
        let cases = [
            // int64 microseconds (useInt64Timestamp, bqemulator)
            ("1796040000123456", 1_796_040_000_123_456),
            ("-1000000", -1_000_000),
            ("0", 0),
            // float seconds (real BigQuery's default)
            ("1.7934912E9", 1_793_491_200_000_000),
            ("1.796040000123456E9", 1_796_040_000_123_456),
            // shortest-double renderings round to the nearest microsecond
            ("1.7960400001234558E9", 1_796_040_000_123_456),
            ("1.7960400001234562E9", 1_796_040_000_123_456),
            ("-1.0E9", -1_000_000_000_000_000),
            ("-6.21355968E10", -62_135_596_800_000_000),
            ("2.534023007999999E11", 253_402_300_799_999_900),
            ("0.0", 0),
            ("1.5E-6", 2),
        ];
        for (input, want) in cases {
            assert_eq!(timestamp_micros(input), Ok(want), "timestamp {input:?}");
        }
        assert!(timestamp_micros("1.0E30").is_err());
        assert!(timestamp_micros("soon").is_err());
    }
}
