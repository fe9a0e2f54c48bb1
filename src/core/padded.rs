//! Where the actual data of a DYNAMIC tensor lies in its bucket's buffer.
//! A bucket's tensor is contiguous at the bucket's shape; a replay of
//! smaller sizes holds its data at the start of each dimension that varies
//! and zeros past it. Collapsed around the dimensions that vary, every
//! supported tensor is `lead x X x mid x Y x inner` (X following one of the
//! bucket's sizes, Y, when there is one, the other, `lead` 1 then), so its
//! actual data is `rows` blocks of `width` bytes, block i at `i * pitch`,
//! and the rest of the bucket's bytes is padding.

/// Which of a bucket's two sizes a dimension follows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Size {
    First,
    Second,
}

/// A DYNAMIC tensor's shape collapsed around the dimensions that vary.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Collapsed {
    /// The product of the dimensions before the first varying one.
    pub lead: u64,
    /// The size the first varying dimension follows.
    pub x: Size,
    /// The product of the dimensions between the two varying ones (1
    /// with one).
    pub mid: u64,
    /// The size the second varying dimension follows, if there is one.
    pub y: Option<Size>,
    /// Bytes of the dimensions after the last varying one.
    pub inner: u64,
}

/// The actual data of a DYNAMIC tensor in its bucket's buffer: `rows`
/// blocks of `width` bytes, block i at `i * pitch`; the buffer's other
/// bytes (up to `bytes`) are padding. Contiguous data is one block
/// (`rows` 1, `pitch` its width).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Padded {
    pub rows: u64,
    pub width: u64,
    pub pitch: u64,
    /// The bucket's bytes.
    pub bytes: u64,
}

impl Padded {
    /// Whether the data is one block at the start of the buffer.
    pub fn contiguous(&self) -> bool {
        self.rows <= 1
    }

    /// The bytes of actual data.
    pub fn data(&self) -> u64 {
        self.rows * self.width
    }
}

impl Collapsed {
    /// Collapses `shape` (of `elem`-byte elements) around dimension `d1`
    /// (following the first size) and `d2` (the second); at least one is
    /// given, both inside the shape and different. None where the two
    /// vary with a dimension of more than one element before both (the
    /// data would not be `rows` blocks of one pitch).
    pub fn of(shape: &[i64], elem: u64, d1: Option<usize>, d2: Option<usize>) -> Option<Collapsed> {
        let dims: Vec<(usize, Size)> = match (d1, d2) {
            (Some(a), Some(b)) if a < b => vec![(a, Size::First), (b, Size::Second)],
            (Some(a), Some(b)) if b < a => vec![(b, Size::Second), (a, Size::First)],
            (Some(a), None) => vec![(a, Size::First)],
            (None, Some(b)) => vec![(b, Size::Second)],
            _ => return None,
        };
        let prod = |r: std::ops::Range<usize>| shape[r].iter().map(|&d| d as u64).product::<u64>();
        let (first, last) = (dims[0].0, dims[dims.len() - 1].0);
        if last >= shape.len() {
            return None;
        }
        let lead = prod(0..first);
        if dims.len() == 2 && lead != 1 {
            return None;
        }
        Some(Collapsed {
            lead,
            x: dims[0].1,
            mid: if dims.len() == 2 {
                prod(first + 1..last)
            } else {
                1
            },
            y: dims.get(1).map(|d| d.1),
            inner: prod(last + 1..shape.len()) * elem,
        })
    }

    /// Whether the tensor varies on its first dimension with the first
    /// size alone: a bucket's data is then a prefix of whole rows of
    /// `inner` bytes.
    pub fn rows_first(&self) -> bool {
        self.lead == 1 && self.x == Size::First && self.y.is_none()
    }

    /// The data of a bucket of sizes `bucket` holding actual sizes
    /// `actual` (each at most the bucket's).
    pub fn at(&self, bucket: (u64, u64), actual: (u64, u64)) -> Padded {
        let pick = |s: Size, v: (u64, u64)| match s {
            Size::First => v.0,
            Size::Second => v.1,
        };
        let (bx, nx) = (pick(self.x, bucket), pick(self.x, actual));
        let p = match self.y {
            None => Padded {
                rows: self.lead,
                width: nx * self.inner,
                pitch: bx * self.inner,
                bytes: self.lead * bx * self.inner,
            },
            Some(y) => {
                let (by, ny) = (pick(y, bucket), pick(y, actual));
                Padded {
                    rows: nx * self.mid,
                    width: ny * self.inner,
                    pitch: by * self.inner,
                    bytes: bx * self.mid * by * self.inner,
                }
            }
        };
        if p.rows <= 1 || p.width == p.pitch {
            let data = p.rows * p.width;
            return Padded {
                rows: 1,
                width: data,
                pitch: data,
                bytes: p.bytes,
            };
        }
        p
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Byte by byte: which bytes of the bucket's buffer hold data, by the
    /// coordinates of each element.
    fn slow(shape: &[i64], d1: Option<usize>, d2: Option<usize>, actual: (u64, u64)) -> Vec<bool> {
        let n: usize = shape.iter().product::<i64>() as usize;
        (0..n)
            .map(|mut e| {
                let mut inside = true;
                for k in (0..shape.len()).rev() {
                    let c = e as u64 % shape[k] as u64;
                    e /= shape[k] as usize;
                    if Some(k) == d1 && c >= actual.0 || Some(k) == d2 && c >= actual.1 {
                        inside = false;
                    }
                }
                inside
            })
            .collect()
    }

    fn fast(p: &Padded) -> Vec<bool> {
        (0..p.bytes)
            .map(|b| b / p.pitch.max(1) < p.rows && b % p.pitch.max(1) < p.width)
            .collect()
    }

    #[test]
    fn the_data_lies_where_the_coordinates_say() {
        let cases: &[(&[i64], Option<usize>, Option<usize>)] = &[
            (&[4, 3, 2], Some(0), None),
            (&[4, 3, 2], Some(1), None),
            (&[4, 3, 2], Some(2), None),
            (&[4, 3, 2], Some(0), Some(1)),
            (&[4, 3, 2], Some(1), Some(0)),
            (&[4, 3, 2], Some(0), Some(2)),
            (&[4, 3, 2], None, Some(1)),
            (&[1, 4, 3, 2], Some(1), Some(3)),
            (&[5], Some(0), None),
        ];
        for &(shape, d1, d2) in cases {
            let c = Collapsed::of(shape, 1, d1, d2).unwrap();
            let b = (
                d1.map_or(1, |d| shape[d] as u64),
                d2.map_or(1, |d| shape[d] as u64),
            );
            for n1 in 1..=b.0 {
                for n2 in 1..=b.1 {
                    let p = c.at(b, (n1, n2));
                    assert_eq!(p.bytes, shape.iter().product::<i64>() as u64);
                    assert_eq!(
                        fast(&p),
                        slow(shape, d1, d2, (n1, n2)),
                        "{shape:?} {d1:?} {d2:?} {n1} {n2}"
                    );
                }
            }
        }
    }

    #[test]
    fn two_dimensions_after_a_lead_are_not_rows_of_one_pitch() {
        assert_eq!(Collapsed::of(&[2, 4, 3], 4, Some(1), Some(2)), None);
        assert_eq!(Collapsed::of(&[4, 3], 4, Some(2), None), None);
        assert_eq!(Collapsed::of(&[4, 3], 4, Some(1), Some(1)), None);
        let c = Collapsed::of(&[2, 4, 3], 4, Some(0), None).unwrap();
        assert!(c.rows_first());
        assert!(!Collapsed::of(&[2, 4, 3], 4, Some(1), None)
            .unwrap()
            .rows_first());
        // The first dimension, whole: contiguous.
        assert!(c.at((2, 1), (1, 1)).contiguous());
        let t = Collapsed::of(&[2, 4, 3], 4, Some(1), None).unwrap();
        let p = t.at((4, 1), (3, 1));
        assert_eq!((p.rows, p.width, p.pitch, p.bytes), (2, 36, 48, 96));
        assert!(t.at((4, 1), (4, 1)).contiguous());
    }
}
