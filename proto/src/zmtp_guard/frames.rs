//! Following a ZMTP 3 byte stream's framing, and bounding its messages: the 64-byte
//! greeting, then frames (a flags byte, a 1- or 8-byte big-endian length, the body). A
//! command frame stands alone; a data frame with the `more` flag is followed by more frames
//! of its message.

/// Largest message a peer may send, all its frames together: a vLLM batch of events or one
/// replayed batch is kilobytes to a few megabytes.
pub const MAX_MESSAGE_BYTES: u64 = 64 << 20;

/// Most frames in one message: a live batch has three, a replay reply a few.
pub const MAX_MESSAGE_FRAMES: u32 = 1024;

/// What a frame costs a budget ([`Frames::with_budget`]) beyond its bytes: about what the
/// socket keeps for it besides them (a vector or a `Bytes` and its allocation).
pub const FRAME_CHARGE: u64 = 32;

/// A ZMTP 3.1 greeting with the NULL mechanism, as a peer sends it first (for tests and
/// probes).
pub const NULL_GREETING: [u8; 64] = {
    let mut greeting = [0u8; 64];
    greeting[0] = 0xff;
    greeting[8] = 1;
    greeting[9] = 0x7f;
    (greeting[10], greeting[11]) = (3, 1);
    (greeting[12], greeting[13], greeting[14], greeting[15]) = (b'N', b'U', b'L', b'L');
    greeting
};

/// Why a peer's stream was cut.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refused {
    /// A frame's announced length, or a message's bytes with it, over [`MAX_MESSAGE_BYTES`].
    Bytes(u64),
    /// A message's frames over [`MAX_MESSAGE_FRAMES`].
    Frames(u32),
    /// The connection's data over its budget ([`Frames::with_budget`]): bytes so far.
    Budget(u64),
}

/// Where a peer's byte stream is in ZMTP 3's framing, and how big the message being
/// sent is so far.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Frames {
    at: At,
    /// Bytes and frames of the message so far, the frame being read included.
    message_bytes: u64,
    message_frames: u32,
    /// What the connection may send in all: its frames' bytes, each frame charged
    /// [`FRAME_CHARGE`] more.
    budget: u64,
    /// What it has sent so far, counted the same way.
    spent: u64,
    /// A command frame (the handshake's READY, first) has been read whole.
    handshaken: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum At {
    /// Bytes of the 64-byte greeting still to come.
    Greeting(usize),
    Flags,
    /// A length being read: the frame's flags, its width (1 or 8 bytes), bytes read so far
    /// and their value.
    Length {
        flags: u8,
        width: u8,
        read: u8,
        value: u64,
    },
    /// Body bytes still to come; whether the frame is a command, and whether it ends a
    /// message.
    Body {
        left: u64,
        command: bool,
        ends_message: bool,
    },
}

impl Default for Frames {
    fn default() -> Self {
        Self::with_budget(u64::MAX)
    }
}

impl Frames {
    /// A stream that may send `budget` in all, its frames' bytes and [`FRAME_CHARGE`] a
    /// frame: for a peer that only subscribes or asks, so that it cannot grow what the
    /// socket keeps of it (`zeromq`'s PUB keeps every subscription it is sent).
    pub fn with_budget(budget: u64) -> Self {
        Self {
            at: At::Greeting(64),
            message_bytes: 0,
            message_frames: 0,
            budget,
            spent: 0,
            handshaken: false,
        }
    }

    /// True once the peer has sent its greeting and a whole command (its READY).
    pub fn handshaken(&self) -> bool {
        self.handshaken
    }

    /// True once the peer's greeting has passed.
    pub fn greeted(&self) -> bool {
        !matches!(self.at, At::Greeting(_))
    }

    /// Follows `bytes`; why they go over the limits, if they do.
    pub fn feed(&mut self, mut bytes: &[u8]) -> Result<(), Refused> {
        while let Some(&first) = bytes.first() {
            let (at, used) = match self.at {
                At::Greeting(left) => {
                    let used = left.min(bytes.len());
                    (if used == left { At::Flags } else { At::Greeting(left - used) }, used)
                }
                // Bit 1 of the flags: an 8-byte length.
                At::Flags => (
                    At::Length {
                        flags: first,
                        width: if first & 0b10 != 0 { 8 } else { 1 },
                        read: 0,
                        value: 0,
                    },
                    1,
                ),
                At::Length { flags, width, read, value } => {
                    let value = value << 8 | u64::from(first);
                    if read + 1 < width {
                        (At::Length { flags, width, read: read + 1, value }, 1)
                    } else {
                        (self.frame(flags, value)?, 1)
                    }
                }
                At::Body { left, command, ends_message } => {
                    let used = left.min(bytes.len() as u64);
                    (
                        if used == left {
                            self.end(command, ends_message)
                        } else {
                            At::Body { left: left - used, command, ends_message }
                        },
                        used as usize,
                    )
                }
            };
            self.at = at;
            bytes = &bytes[used..];
        }
        Ok(())
    }

    /// A frame of `len` bytes begins: refused if it takes its message or the connection
    /// over the limits.
    fn frame(&mut self, flags: u8, len: u64) -> Result<At, Refused> {
        self.spent = self.spent.saturating_add(len).saturating_add(FRAME_CHARGE);
        if self.spent > self.budget {
            return Err(Refused::Budget(self.spent));
        }
        // Bit 2: a command, which stands alone: `zeromq` handles it and goes on with the
        // message it is in the middle of, so it neither counts toward that message nor
        // ends it. Bit 0 of a data frame: more frames of its message follow.
        let command = flags & 0b100 != 0;
        let ends_message = !command && flags & 0b1 == 0;
        if command {
            if len > MAX_MESSAGE_BYTES {
                return Err(Refused::Bytes(len));
            }
        } else {
            self.message_bytes = self.message_bytes.saturating_add(len);
            if self.message_bytes > MAX_MESSAGE_BYTES {
                return Err(Refused::Bytes(self.message_bytes));
            }
            self.message_frames += 1;
            if self.message_frames > MAX_MESSAGE_FRAMES {
                return Err(Refused::Frames(self.message_frames));
            }
        }
        Ok(if len == 0 {
            self.end(command, ends_message)
        } else {
            At::Body { left: len, command, ends_message }
        })
    }

    /// A frame ended, and with it its message if `ends_message`.
    fn end(&mut self, command: bool, ends_message: bool) -> At {
        self.handshaken |= command;
        if ends_message {
            (self.message_bytes, self.message_frames) = (0, 0);
        }
        At::Flags
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A ZMTP 3.1 greeting (NULL mechanism), then `frames` (flags, body).
    fn stream(frames: &[(u8, &[u8])]) -> Vec<u8> {
        let mut bytes = NULL_GREETING.to_vec();
        for &(flags, body) in frames {
            if body.len() > 255 {
                bytes.push(flags | 0b10);
                bytes.extend_from_slice(&(body.len() as u64).to_be_bytes());
            } else {
                bytes.extend_from_slice(&[flags, body.len() as u8]);
            }
            bytes.extend_from_slice(body);
        }
        bytes
    }

    /// The result of feeding `bytes` cut at `cut`, and then byte by byte.
    fn fed(bytes: &[u8], cut: usize) -> [Result<Frames, Refused>; 2] {
        let mut frames = Frames::default();
        let split = frames.feed(&bytes[..cut]).and_then(|()| frames.feed(&bytes[cut..])).map(|()| frames);
        let mut frames = Frames::default();
        let bytewise = bytes.chunks(1).try_for_each(|b| frames.feed(b)).map(|()| frames);
        [split, bytewise]
    }

    #[test]
    fn frames_are_followed_across_any_split() {
        let long = vec![7u8; 300];
        let bytes = stream(&[(0b100, b"\x05READY"), (0b1, b"topic"), (0b1, b""), (0, &long), (0, b"x")]);
        for cut in 0..bytes.len() {
            for result in fed(&bytes, cut) {
                assert_eq!(
                    result,
                    // 6 + 5 + 0 + 300 + 1 bytes in 5 frames.
                    Ok(Frames {
                        at: At::Flags,
                        message_bytes: 0,
                        message_frames: 0,
                        budget: u64::MAX,
                        spent: 312 + 5 * FRAME_CHARGE,
                        handshaken: true,
                    }),
                    "cut {cut}"
                );
            }
        }
    }

    #[test]
    fn a_huge_announced_length_is_refused_before_it_is_complete_downstream() {
        let bytes = crate::zmtp_guard::huge_frame();
        let mut frames = Frames::default();
        // Everything but the length's last byte passes...
        assert_eq!(frames.feed(&bytes[..bytes.len() - 1]), Ok(()));
        // ...and that byte is refused, so the socket never holds the whole length.
        assert_eq!(frames.feed(&bytes[bytes.len() - 1..]), Err(Refused::Bytes(1 << 62)));
    }

    #[test]
    fn a_message_is_bounded_in_all_its_frames_and_bytes() {
        // Two frames that each fit but together go past the limit.
        let half = MAX_MESSAGE_BYTES / 2;
        let frame = |flags: u8| {
            let mut frame = vec![flags | 0b10];
            frame.extend_from_slice(&half.to_be_bytes());
            frame.resize(frame.len() + half as usize, 0);
            frame
        };
        let mut parts = stream(&[(0b1, b"topic")]);
        parts.extend(frame(0b1));
        parts.extend(frame(0));
        assert_eq!(Frames::default().feed(&parts), Err(Refused::Bytes(2 * half + 5)));
        // The same frames as messages of their own pass.
        let mut separate = stream(&[(0, b"topic")]);
        separate.extend(frame(0));
        separate.extend(frame(0));
        assert_eq!(Frames::default().feed(&separate), Ok(()));
        // Endless empty frames of one message.
        let empty: Vec<(u8, &[u8])> = vec![(0b1, b""); MAX_MESSAGE_FRAMES as usize + 1];
        assert_eq!(Frames::default().feed(&stream(&empty)), Err(Refused::Frames(MAX_MESSAGE_FRAMES + 1)));
        let ended: Vec<(u8, &[u8])> = vec![(0, b""); MAX_MESSAGE_FRAMES as usize + 1];
        assert_eq!(Frames::default().feed(&stream(&ended)), Ok(()));
    }

    #[test]
    fn a_command_inside_a_message_neither_ends_it_nor_counts_toward_it() {
        let half = vec![0u8; (MAX_MESSAGE_BYTES / 2) as usize];
        let ready: &[u8] = b"\x05READY";
        let bytes = stream(&[(0b1, &half), (0b100, ready), (0b1, &half), (0b100, ready), (0, b"x")]);
        assert_eq!(Frames::default().feed(&bytes), Err(Refused::Bytes(MAX_MESSAGE_BYTES + 1)));
        let frames: Vec<(u8, &[u8])> =
            (0..=MAX_MESSAGE_FRAMES).flat_map(|_| [(0b1, &b""[..]), (0b100, ready)]).collect();
        assert_eq!(Frames::default().feed(&stream(&frames)), Err(Refused::Frames(MAX_MESSAGE_FRAMES + 1)));
    }

    #[test]
    fn a_budget_bounds_all_a_connection_sends() {
        // Subscriptions of 3 bytes and commands of 6 and 5, each frame charged more.
        let bytes = stream(&[(0b100, b"\x05READY"), (0, b"\x01ab"), (0b100, b"\x04PING"), (0, b"\x01cd")]);
        let all = 17 + 4 * FRAME_CHARGE;
        let mut frames = Frames::with_budget(all);
        assert!(!frames.handshaken());
        assert_eq!(frames.feed(&bytes), Ok(()));
        assert!(frames.handshaken());
        assert_eq!(Frames::with_budget(all - 1).feed(&bytes), Err(Refused::Budget(all)));
        // Commands alone are charged too.
        let pings: Vec<(u8, &[u8])> = vec![(0b100, b"\x04PING"); 10];
        assert_eq!(
            Frames::with_budget(all).feed(&stream(&pings)),
            Err(Refused::Budget(4 * (5 + FRAME_CHARGE)))
        );
    }
}
