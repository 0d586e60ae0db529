"""Video bytes → sampled, upright, resized frames for Qwen2.5-VL, sampled and sized as
qwen-vl-utils does (`smart_nframes`'s frame count, `fetch_video`'s pixel budget shared across
the frames) and resized with Qwen's `smart_resize`, so the engine's processor keeps them as given.

Two passes over the container, both with PyAV:

1. Demux only (no decoding): every packet's timestamps and key flag. That is cheap, and it gives
   the exact presentation time of every frame, so sampling picks frames by timestamp (correct for
   variable-frame-rate phone video, where frame index ≠ time) and knows exactly which packets must
   be decoded to reach each chosen frame.
2. Decode only what is needed: from the key frame before each chosen frame up to that frame. Long
   stretches without a chosen frame are skipped — with a container seek when the stretch is long,
   by dropping packets unseen when it is short. Dense sampling thus decodes sequentially and
   sparse sampling decodes a GOP prefix per frame, never the whole video. Within a stretch, an
   H.264 frame that no other frame references and that is not itself chosen is not decoded at
   all (the decoder's skip_frame="NONREF", set per packet): about half of the frames of a
   B-frame stream, a third of the decode time, and not one output pixel changes.

Timestamps are seconds from the first shown frame (MPEG-TS streams start at 1.4 s; users want
"seconds into the video"). Frames are turned upright from the display matrix exactly as ffmpeg's
autorotate does, then resized with Pillow's BICUBIC: measured against torchvision's antialiased
bicubic (what qwen-vl-utils uses) Pillow differs by 0.005-0.15/255 on average (at most 1/255 on
the benchmark's 720p clip); swscale differs by 2/255 on average and up to 114/255 at colour
edges, Pillow with reducing_gap=1 by 0.7/255 (up to 33/255), so neither faster resize is used.

Cost, measured on 720p H.264 (bench/HISTORY.md, preprocessing runs): decoding dominates (~1-3
ms a frame, and every reference frame of a GOP up to the chosen one must be decoded); the RGB
conversion and resize of a chosen frame (~10 ms) run on a helper thread beside the decoder, and
once the first frame has fixed the output size a second decoder takes the later half of the
stretches. Both overlap only when a core is free: they shorten the wall time of one video, not
the CPU time.

Cut and damaged files are judged by time, not by counts. A frame count in a header is no
evidence: AVI counts the frames a variable-rate camera skipped, and an index may count a frame
more than it holds. What counts is the time span that decodes, against the duration the
container declares (or, without one, the span the demuxer found): frames come from what decodes,
the result says `partial` when it falls short, and only when less than
`VideoParams.min_decoded_fraction` of it decodes is the video refused (`UndecodableVideo`). A cut
mp4 whose index was at the end has nothing to decode and is refused; a cut MPEG-TS or Ogg
declares no duration beyond its data and cannot be told from a short one.

A video whose plan needs more visual tokens than `VideoParams.max_tokens` (what its job's
context leaves it) is fitted rather than refused, before any frame is decoded: the frames shrink
first, down to Qwen's video floor (`min_pixels`, with qwen-vl-utils' 5 % margin), and only then
does the strategy plan again with fewer frames (even counts, still spread over the whole video),
which get the largest size that fits. It is refused (`TooManyVisualTokens`) only when two frames
at the floor need more. The sampling rate reported (`sample_fps`) is the fitted plan's.

Other errors are typed: no video stream → `UnsupportedMedia` (an audio file is a real, decodable
media file, just not a kind this worker captions); data no frame decodes from →
`UndecodableVideo`; a stream that yields no frame → `NoFrames`; frames above
`max_source_pixels` → `TooLarge`.

The modules follow the steps, so each can be read (and its knobs patched by the benchmarks and
tests) on its own: `container` (opening, stream choice), `timeline` (the first pass), `sampling`
(which frames, at what size), `schedule` (which packets, on which decoder), `decode` (the second
pass), `orientation` (the display matrix), `partial` (how much of a damaged video is enough) and
`pipeline`, which runs them in order.
"""

from mmworker_preprocess.params import frame_max_pixels
from mmworker_preprocess.video.pipeline import prepare_video
from mmworker_preprocess.video.stats import DecodeStats

__all__ = ["DecodeStats", "frame_max_pixels", "prepare_video"]
