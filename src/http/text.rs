//! Free text from clients (titles, rules, payment references): no NUL (Postgres refuses
//! it), a length in characters, and, when given, something a person can see.

use crate::http::error::{AppError, AppResult};

/// Whether a field may be left empty.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Needed {
    Required,
    /// Empty is fine; text that is there must show.
    Optional,
}

/// `value` checked as the field `field`: at most `max` characters, no NUL, and, unless
/// optional and empty, at least one visible character.
pub(crate) fn text(field: &str, value: &str, max: usize, needed: Needed) -> AppResult<String> {
    if value.contains('\0') {
        return Err(AppError::invalid(format!(
            "{field} must not contain NUL bytes"
        )));
    }
    let empty_allowed = needed == Needed::Optional && value.is_empty();
    if !empty_allowed && !value.chars().any(is_visible) {
        return Err(AppError::invalid(match needed {
            Needed::Required => format!(
                "{field} must not be empty or blank (only whitespace or invisible characters)"
            ),
            Needed::Optional => format!(
                "{field} must be empty or hold a visible character (not only whitespace or \
                 invisible characters)"
            ),
        }));
    }
    if value.chars().count() > max {
        return Err(AppError::invalid(format!(
            "{field} must be at most {max} characters"
        )));
    }
    Ok(value.to_string())
}

/// Whether a character shows: neither whitespace nor one of Unicode's
/// default-ignorable code points (DerivedCoreProperties.txt), which render as nothing:
/// zero-width spaces, joiners and non-joiners, U+FEFF, U+2060, soft hyphens, bidi
/// controls, variation selectors, Hangul fillers, tags.
pub(crate) fn is_visible(c: char) -> bool {
    !c.is_whitespace()
        && !matches!(c,
            '\u{00AD}' | '\u{034F}' | '\u{061C}' | '\u{115F}'..='\u{1160}'
            | '\u{17B4}'..='\u{17B5}' | '\u{180B}'..='\u{180F}' | '\u{200B}'..='\u{200F}'
            | '\u{202A}'..='\u{202E}' | '\u{2060}'..='\u{206F}' | '\u{3164}'
            | '\u{FE00}'..='\u{FE0F}' | '\u{FEFF}' | '\u{FFA0}' | '\u{FFF0}'..='\u{FFF8}'
            | '\u{1BCA0}'..='\u{1BCA3}' | '\u{1D173}'..='\u{1D17A}' | '\u{E0000}'..='\u{E0FFF}')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_optional_field_is_empty_or_shows_something() {
        for ok in ["", "x", " a ", "\u{200B}b"] {
            assert!(text("f", ok, 10, Needed::Optional).is_ok(), "{ok:?}");
        }
        for bad in [" ", "\u{200B}", "\u{FEFF}\u{2060}", "\u{E0041}", "a\0"] {
            assert!(text("f", bad, 10, Needed::Optional).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_required_field_must_show_something_and_fit() {
        assert!(text("f", "", 10, Needed::Required).is_err());
        assert!(text("f", "\u{00AD}", 10, Needed::Required).is_err());
        assert!(text("f", "héllo", 5, Needed::Required).is_ok());
        assert!(text("f", "héllo!", 5, Needed::Required).is_err());
    }
}
