// Text for XML and HTML documents (the SVG pictures and the report page forge writes).
#pragma once

#include <string>
#include <string_view>

namespace forge {

// `text` with &, <, >, " and ' replaced by their entities: safe in element content and in quoted attributes.
std::string xml_escape(std::string_view text);

}  // namespace forge
