//! [`Reader`]: the pull side of the JSON reader, for documents whose large parts must not be
//! one tree at once.

use super::{Json, Limits, ParseError, Parser};

/// A pull reader of one JSON document, for documents too large to hold as one tree: the
/// caller walks the containers it streams (a checkpoint manifest's tensor list, element by
/// element) and takes every other value whole ([`Reader::value`]). The same grammar, limits
/// and errors as [`Json::parse_with`]; duplicate keys of the objects the caller walks are the
/// caller's to check (the keys are handed over).
///
/// ```
/// use lowbit_io::json::{Json, Limits, Reader};
/// let mut r = Reader::new(r#"{"n": 1, "items": [{"a": 1}, {"a": 2}]}"#, Limits::default())?;
/// r.begin_object()?;
/// let mut sum = 0;
/// while let Some((key, _at)) = r.next_key()? {
///     if key == "items" {
///         r.begin_array()?;
///         while r.next_element()? {
///             sum += r.value()?.get("a").as_u64().unwrap_or(0); // one element at a time
///         }
///     } else {
///         r.value()?;
///     }
/// }
/// r.finish()?;
/// assert_eq!(sum, 3);
/// # Ok::<(), lowbit_io::json::ParseError>(())
/// ```
pub struct Reader<'a> {
    p: Parser<'a>,
    /// Per open container: whether no member or element was read yet.
    open: Vec<bool>,
}

impl<'a> Reader<'a> {
    /// A reader at the start of `text`.
    ///
    /// # Errors
    /// A text longer than `limits.max_len`.
    pub fn new(text: &'a str, limits: Limits) -> Result<Reader<'a>, ParseError> {
        if text.len() > limits.max_len {
            return Err(ParseError {
                what: format!("text longer than {} bytes", limits.max_len),
                at: limits.max_len,
            });
        }
        Ok(Reader {
            p: Parser {
                b: text.as_bytes(),
                i: 0,
                max_depth: limits.max_depth,
            },
            open: Vec::new(),
        })
    }

    /// The byte offset reached.
    pub fn offset(&self) -> usize {
        self.p.i
    }

    /// The next byte that is not whitespace, if any (what kind of value follows).
    pub fn peek(&mut self) -> Option<u8> {
        self.p.ws();
        self.p.b.get(self.p.i).copied()
    }

    fn open(&mut self, c: u8, what: &str) -> Result<(), ParseError> {
        if self.open.len() > self.p.max_depth {
            return self.p.err("nesting too deep");
        }
        if self.peek() != Some(c) {
            return self.p.err(what);
        }
        self.p.i += 1;
        self.open.push(true);
        Ok(())
    }

    /// Enters the object that follows.
    ///
    /// # Errors
    /// Anything else follows, or the nesting is too deep.
    pub fn begin_object(&mut self) -> Result<(), ParseError> {
        self.open(b'{', "expected an object")
    }

    /// Enters the array that follows.
    ///
    /// # Errors
    /// Anything else follows, or the nesting is too deep.
    pub fn begin_array(&mut self) -> Result<(), ParseError> {
        self.open(b'[', "expected an array")
    }

    /// Whether the open container has no more items; steps over the `,` before the next one
    /// or leaves the container at its end.
    fn more(&mut self, close: u8, what: &str) -> Result<bool, ParseError> {
        let Some(first) = self.open.last_mut() else {
            return self.p.err("no container is open");
        };
        let first = std::mem::replace(first, false);
        self.p.ws();
        match self.p.b.get(self.p.i) {
            Some(&c) if c == close => {
                self.p.i += 1;
                self.open.pop();
                Ok(false)
            }
            Some(b',') if !first => {
                self.p.i += 1;
                Ok(true)
            }
            _ if first => Ok(true),
            _ => self.p.err(what),
        }
    }

    /// The next member's key and its byte offset, positioned at its value (which the caller
    /// must read next: [`Reader::value`], or walk it); `None` at the object's end (left).
    ///
    /// # Errors
    /// Not a member or the end.
    pub fn next_key(&mut self) -> Result<Option<(String, usize)>, ParseError> {
        if !self.more(b'}', "expected `,` or `}`")? {
            return Ok(None);
        }
        self.p.ws();
        if self.p.b.get(self.p.i) != Some(&b'"') {
            return self.p.err("expected a key");
        }
        let at = self.p.i;
        let k = self.p.string()?;
        self.p.ws();
        if !self.p.eat(":") {
            return self.p.err("expected `:`");
        }
        Ok(Some((k, at)))
    }

    /// Whether another element follows in the open array (then positioned at it, which the
    /// caller must read next); false at the array's end (left).
    ///
    /// # Errors
    /// Neither an element nor the end.
    pub fn next_element(&mut self) -> Result<bool, ParseError> {
        self.more(b']', "expected `,` or `]`")
    }

    /// The whole value that follows.
    ///
    /// # Errors
    /// As [`Json::parse_with`], nesting counted from the document's top.
    pub fn value(&mut self) -> Result<Json, ParseError> {
        self.p.value(self.open.len())
    }

    /// Ends the document: every container walked is closed and only whitespace is left.
    ///
    /// # Errors
    /// A container left open, or trailing characters.
    pub fn finish(mut self) -> Result<(), ParseError> {
        if !self.open.is_empty() {
            return self.p.err("unexpected end");
        }
        self.p.ws();
        if self.p.i != self.p.b.len() {
            return self.p.err("trailing characters");
        }
        Ok(())
    }
}
